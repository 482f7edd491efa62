// kvtd/transport/block_header.h - the header a block travels with from one daemon to another:
// which of the receiver's grants and which of its blocks it fills, its length, and the checksum
// of its bytes taken at the source. The type, its encoder and its parser side by side; the parser
// treats its input as hostile (a peer wrote it) and names what is wrong.
//
// Wire form, 40 bytes, little-endian: magic "KVTB" (u32), version (u16), flags (u16, 0), block
// index (u32), reserved (u32, 0), grant (u64), length (u64), checksum (u64, XXH3-64).
//
// Pure functions: thread-safe, no allocation but the error message.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "kvtd/proto/expected.h"
#include "kvtd/transport/transport_errc.h"

namespace kvtd::transport {

struct BlockHeader {
  std::uint64_t grant = 0;     // the receiver's grant this block is for
  std::uint32_t index = 0;     // which of the grant's blocks
  std::uint64_t length = 0;    // bytes of the block
  std::uint64_t checksum = 0;  // XXH3-64 of the block's bytes at the source
};

inline constexpr std::size_t kBlockHeaderBytes = 40;
inline constexpr std::uint32_t kBlockHeaderMagic = 0x4254564b;  // "KVTB" read as a little-endian u32
inline constexpr std::uint16_t kBlockHeaderVersion = 1;

// `h` in its wire form.
std::array<std::byte, kBlockHeaderBytes> encode_block_header(const BlockHeader& h);

// The header in `bytes`, or kMalformed naming the first thing wrong (length, magic, version,
// a non-zero reserved field).
Result<BlockHeader, TransportErrc> parse_block_header(std::span<const std::byte> bytes);

// XXH3-64 of `bytes`: what the source puts in the header and the destination recomputes.
std::uint64_t block_checksum(std::span<const std::byte> bytes);

}  // namespace kvtd::transport
