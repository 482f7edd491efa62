// The few msgpack types KV events need, written big-endian as the msgpack spec says
// (https://github.com/msgpack/msgpack/blob/master/spec.md): nil, bool, int, float64, str,
// bin, array and map headers. Sizes over 2^32-1 cannot occur here (bounded batches).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace kvtd::events {

class MsgpackWriter {
 public:
  void nil();
  void integer(std::int64_t v);
  void float64(double v);
  void str(std::string_view s);
  void bin(std::string_view bytes);
  void array(std::uint32_t n);  // the n elements follow
  void map(std::uint32_t n);    // n key, value pairs follow
  const std::string& bytes() const { return out_; }
  std::string take() { return std::move(out_); }

 private:
  void be(std::uint64_t v, int bytes);
  void sized(std::uint32_t n, unsigned char m8, unsigned char m16, unsigned char m32);
  void header(std::uint32_t n, unsigned char fix, unsigned fix_max, unsigned char m16, unsigned char m32);
  std::string out_;
};

}  // namespace kvtd::events
