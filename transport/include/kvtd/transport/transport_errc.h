// kvtd/transport/transport_errc.h - the transport's error codes, by what the caller does next.
#pragma once

namespace kvtd::transport {

enum class TransportErrc {
  kInvalidArgument,   // the caller asked for something impossible: fix the call
  kMalformed,         // a peer's bytes are not a valid message: drop them (the peer is suspect)
  kNotGranted,        // a block for no live grant, outside it, or twice: dropped, nothing written
  kChecksumMismatch,  // the bytes that arrived are not the bytes sent: the block failed
  kUnavailable,       // UCX or the peer cannot be reached: retry after reconnecting
  kInternal,          // UCX reported an error it should not: report it
};

constexpr const char* transport_errc_name(TransportErrc c) {
  switch (c) {
    case TransportErrc::kInvalidArgument: return "invalid_argument";
    case TransportErrc::kMalformed: return "malformed";
    case TransportErrc::kNotGranted: return "not_granted";
    case TransportErrc::kChecksumMismatch: return "checksum_mismatch";
    case TransportErrc::kUnavailable: return "unavailable";
    case TransportErrc::kInternal: return "internal";
  }
  return "unknown";
}

}  // namespace kvtd::transport
