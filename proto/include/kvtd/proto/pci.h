// kvtd/proto/pci.h - a GPU's PCI address packed into 32 bits, how tensors name their device.
//
// CUDA ordinals differ per process (CUDA_VISIBLE_DEVICES reorders and hides devices), so the
// engine and a daemon can agree on an ordinal and still mean two GPUs. The PCI address is the
// same everywhere: "DDDD:BB:DD.F" (domain, bus, device, function; CUDA's and NVML's spellings,
// the domain 4 or 8 hex digits with NVML's leading zeros), packed as domain << 16 | bus << 8 |
// device << 3 | function. 0 means unknown (a GPU is never at 0000:00:00.0).
//
// Pure functions, header-only, C++20.
#pragma once

#include <cstdint>
#include <cstdio>
#include <optional>
#include <string>
#include <string_view>

namespace kvtd::proto {

constexpr std::optional<std::uint32_t> parse_pci_bus_id(std::string_view s) {
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  auto field = [&](std::string_view f, std::uint64_t max) -> std::optional<std::uint32_t> {
    if (f.empty() || f.size() > 8) return std::nullopt;
    std::uint64_t v = 0;
    for (char c : f) {
      const int h = hex(c);
      if (h < 0) return std::nullopt;
      v = v * 16 + static_cast<std::uint64_t>(h);
    }
    if (v > max) return std::nullopt;
    return static_cast<std::uint32_t>(v);
  };
  const auto c1 = s.find(':');
  if (c1 == std::string_view::npos) return std::nullopt;
  const auto c2 = s.find(':', c1 + 1);
  const auto dot = s.find('.', c2 == std::string_view::npos ? c1 : c2);
  if (c2 == std::string_view::npos || dot == std::string_view::npos) return std::nullopt;
  const auto domain = field(s.substr(0, c1), 0xFFFF);
  const auto bus = field(s.substr(c1 + 1, c2 - c1 - 1), 0xFF);
  const auto dev = field(s.substr(c2 + 1, dot - c2 - 1), 0x1F);
  const auto fn = field(s.substr(dot + 1), 0x7);
  if (!domain || !bus || !dev || !fn) return std::nullopt;
  const std::uint32_t packed = (*domain << 16) | (*bus << 8) | (*dev << 3) | *fn;
  if (packed == 0) return std::nullopt;
  return packed;
}

inline std::string pci_bus_id_string(std::uint32_t packed) {
  char b[16];
  std::snprintf(b, sizeof b, "%04x:%02x:%02x.%x", packed >> 16, (packed >> 8) & 0xFF, (packed >> 3) & 0x1F,
                packed & 0x7);
  return b;
}

static_assert(parse_pci_bus_id("0000:17:00.0") == 0x1700u);
static_assert(parse_pci_bus_id("00000000:3B:00.0") == 0x3B00u);  // NVML's spelling
static_assert(!parse_pci_bus_id("0000:17:00") && !parse_pci_bus_id("0000:00:00.0") && !parse_pci_bus_id("x"));

}  // namespace kvtd::proto
