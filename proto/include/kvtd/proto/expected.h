// kvtd/proto/expected.h - a small value-or-error result for module boundaries.
//
// nvcc 13 has no std::expected, and headers that .cu files include must stay C++20, so every
// module returns Result<T, E> where E is that module's `enum class` of error codes. An Error
// carries the code and a human-readable message naming the problem.
//
// Thread-safety: plain values; no shared state. Copyable and movable when T is.
#pragma once

#include <string>
#include <utility>
#include <variant>

namespace kvtd {

template <typename Code>
struct Error {
  Code code;
  std::string message;
};

template <typename Code>
[[nodiscard]] inline Error<Code> make_error(Code code, std::string message) {
  return Error<Code>{code, std::move(message)};
}

template <typename T, typename Code>
class [[nodiscard]] Result {
 public:
  Result(T value) : v_(std::in_place_index<0>, std::move(value)) {}          // NOLINT implicit
  Result(Error<Code> err) : v_(std::in_place_index<1>, std::move(err)) {}    // NOLINT implicit

  bool ok() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return ok(); }

  // Precondition: ok().
  T& value() & { return std::get<0>(v_); }
  const T& value() const& { return std::get<0>(v_); }
  T&& value() && { return std::get<0>(std::move(v_)); }
  T* operator->() { return &value(); }
  const T* operator->() const { return &value(); }
  T& operator*() & { return value(); }
  const T& operator*() const& { return value(); }

  // Precondition: !ok().
  const Error<Code>& error() const& { return std::get<1>(v_); }
  Error<Code>&& error() && { return std::get<1>(std::move(v_)); }

 private:
  std::variant<T, Error<Code>> v_;
};

// Result for operations that return nothing on success.
template <typename Code>
class [[nodiscard]] Status {
 public:
  Status() = default;
  Status(Error<Code> err) : err_(std::move(err)), ok_(false) {}  // NOLINT implicit

  bool ok() const noexcept { return ok_; }
  explicit operator bool() const noexcept { return ok_; }
  // Precondition: !ok().
  const Error<Code>& error() const { return err_; }

 private:
  Error<Code> err_{};
  bool ok_ = true;
};

}  // namespace kvtd

// Propagates a failure: `KVTD_TRY(open_x());` returns the error of a failed Result or Status from
// the calling function (whose Result or Status has the same error code), else goes on; a
// Result's value is discarded (for a value, write the `if (!r.ok())` out).
#define KVTD_TRY(expr)                                                                    \
  do {                                                                                    \
    if (auto kvtd_try_ = (expr); !kvtd_try_.ok()) return std::move(kvtd_try_).error(); \
  } while (0)

// Binds a Result's value or propagates its failure, in one statement:
// `KVTD_ASSIGN_OR_RETURN(auto shape, parse_shape(s));` declares `shape` (the value, moved out)
// when parse_shape succeeded, else returns its error from the calling function (whose Result or
// Status has the same error code). `lhs` is a declaration or anything assignable; `expr` is
// evaluated once.
#define KVTD_ASSIGN_OR_RETURN(lhs, expr) KVTD_ASSIGN_OR_RETURN_(KVTD_AOR_NAME_(__LINE__), lhs, expr)
#define KVTD_AOR_NAME_(line) KVTD_AOR_CAT_(kvtd_aor_, line)
#define KVTD_AOR_CAT_(a, b) a##b
#define KVTD_ASSIGN_OR_RETURN_(tmp, lhs, expr)  \
  auto tmp = (expr);                            \
  if (!tmp.ok()) return std::move(tmp).error(); \
  lhs = std::move(tmp).value()
