// kvtd/base/thread_annotations.h - clang's thread-safety attributes (-Wthread-safety), empty for
// other compilers. LevelDB's port/thread_annotations.h and abseil's thread_annotations.h are the
// models. scripts/test.sh builds the whole tree with clang and -Wthread-safety -Werror, so a field
// marked GUARDED_BY(mu) read without mu held fails the build.
//
//   GUARDED_BY(mu)       the field is read and written only with mu held
//   PT_GUARDED_BY(mu)    what the pointer points to is (the pointer itself is not)
//   REQUIRES(mu)         the caller holds mu (the function may not take it)
//   EXCLUDES(mu)         the caller does not hold mu (the function takes it)
//   ACQUIRED_BEFORE(mu)  lock order: this mutex is taken before mu when both are held
#pragma once

#if defined(__clang__)
#define KVTD_THREAD_ANNOTATION(x) __attribute__((x))
#else
#define KVTD_THREAD_ANNOTATION(x)
#endif

#define CAPABILITY(x) KVTD_THREAD_ANNOTATION(capability(x))
#define SCOPED_CAPABILITY KVTD_THREAD_ANNOTATION(scoped_lockable)
#define GUARDED_BY(x) KVTD_THREAD_ANNOTATION(guarded_by(x))
#define PT_GUARDED_BY(x) KVTD_THREAD_ANNOTATION(pt_guarded_by(x))
#define ACQUIRED_BEFORE(...) KVTD_THREAD_ANNOTATION(acquired_before(__VA_ARGS__))
#define ACQUIRED_AFTER(...) KVTD_THREAD_ANNOTATION(acquired_after(__VA_ARGS__))
#define REQUIRES(...) KVTD_THREAD_ANNOTATION(requires_capability(__VA_ARGS__))
#define ACQUIRE(...) KVTD_THREAD_ANNOTATION(acquire_capability(__VA_ARGS__))
#define RELEASE(...) KVTD_THREAD_ANNOTATION(release_capability(__VA_ARGS__))
#define TRY_ACQUIRE(...) KVTD_THREAD_ANNOTATION(try_acquire_capability(__VA_ARGS__))
#define EXCLUDES(...) KVTD_THREAD_ANNOTATION(locks_excluded(__VA_ARGS__))
#define ASSERT_CAPABILITY(x) KVTD_THREAD_ANNOTATION(assert_capability(x))
#define RETURN_CAPABILITY(x) KVTD_THREAD_ANNOTATION(lock_returned(x))
#define NO_THREAD_SAFETY_ANALYSIS KVTD_THREAD_ANNOTATION(no_thread_safety_analysis)
