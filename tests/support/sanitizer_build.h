// sanitizer_build.h - KVTD_SANITIZED_BUILD is 1 when this file is compiled under AddressSanitizer or
// ThreadSanitizer, by gcc or clang, else 0. Tests that measure resident memory or preload a library
// ask it. (gcc says so with __SANITIZE_ADDRESS__ / __SANITIZE_THREAD__, clang only through
// __has_feature: a test that asked gcc's macros alone measured ASan's quarantine under clang.)
#pragma once

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVTD_SANITIZED_BUILD 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define KVTD_SANITIZED_BUILD 1
#endif
#endif

#ifndef KVTD_SANITIZED_BUILD
#define KVTD_SANITIZED_BUILD 0
#endif
