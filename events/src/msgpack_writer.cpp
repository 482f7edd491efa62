#include "msgpack_writer.h"

#include <cstring>

namespace kvtd::events {

void MsgpackWriter::be(std::uint64_t v, int bytes) {
  for (int i = bytes - 1; i >= 0; --i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void MsgpackWriter::nil() { out_.push_back(static_cast<char>(0xc0)); }

void MsgpackWriter::integer(std::int64_t v) {
  if (v >= 0 && v <= 0x7f) {
    out_.push_back(static_cast<char>(v));  // positive fixint
  } else if (v < 0 && v >= -32) {
    out_.push_back(static_cast<char>(0xe0 | (v + 32)));  // negative fixint
  } else if (v >= 0 && v <= 0xffffffffLL) {
    out_.push_back(static_cast<char>(0xce));  // uint 32
    be(static_cast<std::uint64_t>(v), 4);
  } else if (v >= 0) {
    out_.push_back(static_cast<char>(0xcf));  // uint 64
    be(static_cast<std::uint64_t>(v), 8);
  } else {
    out_.push_back(static_cast<char>(0xd3));  // int 64
    be(static_cast<std::uint64_t>(v), 8);
  }
}

void MsgpackWriter::float64(double v) {
  std::uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof bits);
  out_.push_back(static_cast<char>(0xcb));
  be(bits, 8);
}

// A length after its 8-, 16- or 32-bit marker (str 8/16/32, bin 8/16/32).
void MsgpackWriter::sized(std::uint32_t n, unsigned char m8, unsigned char m16, unsigned char m32) {
  const int bytes = n <= 0xff ? 1 : n <= 0xffff ? 2 : 4;
  out_.push_back(static_cast<char>(bytes == 1 ? m8 : bytes == 2 ? m16 : m32));
  be(n, bytes);
}

void MsgpackWriter::str(std::string_view s) {
  const auto n = static_cast<std::uint32_t>(s.size());
  if (n <= 31)
    out_.push_back(static_cast<char>(0xa0 | n));  // fixstr
  else
    sized(n, 0xd9, 0xda, 0xdb);
  out_.append(s);
}

void MsgpackWriter::bin(std::string_view bytes) {
  sized(static_cast<std::uint32_t>(bytes.size()), 0xc4, 0xc5, 0xc6);
  out_.append(bytes);
}

void MsgpackWriter::header(std::uint32_t n, unsigned char fix, unsigned fix_max, unsigned char m16, unsigned char m32) {
  if (n <= fix_max) {
    out_.push_back(static_cast<char>(fix | n));
  } else if (n <= 0xffff) {
    out_.push_back(static_cast<char>(m16));
    be(n, 2);
  } else {
    out_.push_back(static_cast<char>(m32));
    be(n, 4);
  }
}

void MsgpackWriter::array(std::uint32_t n) { header(n, 0x90, 15, 0xdc, 0xdd); }
void MsgpackWriter::map(std::uint32_t n) { header(n, 0x80, 15, 0xde, 0xdf); }

}  // namespace kvtd::events
