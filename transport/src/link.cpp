// The UCX worker behind Link (link.h says what it promises). Every UCX callback runs inside
// ucp_worker_progress on the owning thread, so the state below needs no lock.
#include "kvtd/transport/link.h"

#include <array>
#include <cstring>
#include <ctime>
#include <map>
#include <fmt/format.h>
#include <ucp/api/ucp.h>

#include "kvtd/transport/block_header.h"

namespace kvtd::transport {

namespace {

constexpr unsigned kBlockMessage = 7;  // the active-message id of a block
constexpr std::int64_t kDrainNs = 5'000'000'000;  // how long cancels and closes may take

std::int64_t monotonic_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

std::string ucx_problem(const char* what, ucs_status_t s) { return fmt::format("{}: {}", what, ucs_status_string(s)); }

enum BlockState : std::uint8_t { kOpen, kReceiving, kDone, kFailed };

}  // namespace

struct Link::Impl {
  struct Grant {
    std::vector<std::span<std::byte>> blocks;
    std::vector<std::uint8_t> state;  // BlockState per block
    std::int64_t expires_ns = 0;
    std::size_t received = 0;
    std::size_t in_flight = 0;  // rendezvous receives not yet complete
    bool revoked = false;
    bool erase_when_drained = false;  // revoked with receives in flight: erased by the last one
  };
  struct Receive {
    Impl* impl;
    std::uint64_t grant;
    std::uint32_t index;
    std::uint64_t checksum;
    void* request = nullptr;
  };
  struct Send {
    Impl* impl;
    std::uint64_t id;
    std::array<std::byte, kBlockHeaderBytes> header;
  };
  struct Peer {
    Impl* impl;
    std::uint64_t id;
    ucp_ep_h ep = nullptr;
    bool failed = false;
  };

  LinkOptions options;
  ucp_context_h context = nullptr;
  ucp_worker_h worker = nullptr;
  std::vector<std::byte> address;
  bool cuda = false;
  std::map<std::uint64_t, Grant> grants;
  std::map<std::uint64_t, std::unique_ptr<Peer>> peers;
  std::map<std::uint64_t, std::unique_ptr<Send>> sends;
  std::map<const Receive*, std::unique_ptr<Receive>> receives;
  std::vector<LinkEvent> events;
  std::uint64_t next_peer = 1;
  std::uint64_t next_send = 1;

  ~Impl() { shut_down(); }

  std::int64_t now() const { return options.now_ns ? options.now_ns() : monotonic_ns(); }
  void drive() {
    while (ucp_worker_progress(worker) != 0) {
    }
  }

  // Why a block under header `h` of `length` bytes may not be written, or "" if it may.
  std::string refusal(const BlockHeader& h, std::size_t length) const {
    const auto it = grants.find(h.grant);
    if (it == grants.end() || it->second.revoked) return fmt::format("no live grant {}", h.grant);
    const Grant& g = it->second;
    if (now() >= g.expires_ns) return fmt::format("grant {} has expired", h.grant);
    if (h.index >= g.blocks.size())
      return fmt::format("grant {} has {} blocks; the peer named block {}", h.grant, g.blocks.size(), h.index);
    if (h.length != length || length != g.blocks[h.index].size())
      return fmt::format("block {} of grant {} is {} bytes; the peer sent {}", h.index, h.grant,
                         g.blocks[h.index].size(), length);
    if (g.state[h.index] != kOpen) return fmt::format("block {} of grant {} was written already", h.index, h.grant);
    return {};
  }

  ucs_status_t reject(bool rndv, TransportErrc code, const BlockHeader& h, std::string why) {
    events.push_back({LinkEvent::Kind::kRejected, h.grant, h.index, code, std::move(why)});
    return rndv ? UCS_ERR_REJECTED : UCS_OK;  // a rejected rendezvous fails the peer's send
  }

  void verify(std::uint64_t grant, std::uint32_t index, std::uint64_t expected) {
    Grant& g = grants.at(grant);
    const auto got = block_checksum(g.blocks[index]);
    if (got == expected) {
      g.state[index] = kDone;
      ++g.received;
      events.push_back({LinkEvent::Kind::kReceived, grant, index, TransportErrc::kInternal, {}});
      return;
    }
    g.state[index] = kFailed;
    events.push_back({LinkEvent::Kind::kReceiveFailed, grant, index, TransportErrc::kChecksumMismatch,
                      fmt::format("block {} of grant {}: checksum {:016x}, the source's {:016x} (the bytes changed on "
                                  "the way or at the source before they were read)",
                                  index, grant, got, expected)});
  }

  void fail_receive(std::uint64_t grant, std::uint32_t index, ucs_status_t s) {
    grants.at(grant).state[index] = kFailed;
    events.push_back({LinkEvent::Kind::kReceiveFailed, grant, index, TransportErrc::kUnavailable,
                      ucx_problem(fmt::format("block {} of grant {}: receive", index, grant).c_str(), s)});
  }

  static ucs_status_t on_block(void* arg, const void* header, size_t header_length, void* data, size_t length,
                               const ucp_am_recv_param_t* param);
  static void on_received(void* request, ucs_status_t status, size_t length, void* user_data);
  static void on_sent(void* request, ucs_status_t status, void* user_data);
  static void on_peer_error(void* arg, ucp_ep_h ep, ucs_status_t status);

  void close_endpoint(Peer& p);
  void shut_down();
};

ucs_status_t Link::Impl::on_block(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                  const ucp_am_recv_param_t* param) {
  auto* self = static_cast<Impl*>(arg);
  const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
  auto h = parse_block_header({static_cast<const std::byte*>(header), header_length});
  if (!h.ok()) return self->reject(rndv, TransportErrc::kMalformed, BlockHeader{}, h.error().message);
  if (auto why = self->refusal(*h, length); !why.empty())
    return self->reject(rndv, TransportErrc::kNotGranted, *h, std::move(why));
  Grant& g = self->grants.at(h->grant);
  auto dst = g.blocks[h->index];
  g.state[h->index] = kReceiving;
  if (!rndv) {
    std::memcpy(dst.data(), data, length);
    self->verify(h->grant, h->index, h->checksum);
    return UCS_OK;
  }
  auto r = std::make_unique<Receive>(Receive{self, h->grant, h->index, h->checksum});
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  p.cb.recv_am = &Impl::on_received;
  p.user_data = r.get();
  ucs_status_ptr_t st = ucp_am_recv_data_nbx(self->worker, data, dst.data(), length, &p);
  if (st == nullptr) {
    self->verify(h->grant, h->index, h->checksum);
  } else if (UCS_PTR_IS_ERR(st)) {
    self->fail_receive(h->grant, h->index, UCS_PTR_STATUS(st));
  } else {
    r->request = st;
    ++g.in_flight;
    self->receives.emplace(r.get(), std::move(r));
  }
  return UCS_OK;
}

void Link::Impl::on_received(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
  auto* r = static_cast<Receive*>(user_data);
  Impl* self = r->impl;
  ucp_request_free(request);
  const auto grant = r->grant;
  Grant& g = self->grants.at(grant);
  --g.in_flight;
  if (status == UCS_OK && !g.revoked)
    self->verify(grant, r->index, r->checksum);
  else
    self->fail_receive(grant, r->index, status == UCS_OK ? UCS_ERR_CANCELED : status);
  self->receives.erase(r);
  if (g.erase_when_drained && g.in_flight == 0) self->grants.erase(grant);
}

void Link::Impl::on_sent(void* request, ucs_status_t status, void* user_data) {
  auto* s = static_cast<Send*>(user_data);
  Impl* self = s->impl;
  if (request != nullptr) ucp_request_free(request);
  if (status == UCS_OK) {
    self->events.push_back({LinkEvent::Kind::kSent, s->id, 0, TransportErrc::kInternal, {}});
  } else {
    const auto code = status == UCS_ERR_REJECTED ? TransportErrc::kNotGranted : TransportErrc::kUnavailable;
    self->events.push_back({LinkEvent::Kind::kSendFailed, s->id, 0, code,
                            ucx_problem(fmt::format("send {}", s->id).c_str(), status)});
  }
  self->sends.erase(s->id);
}

void Link::Impl::on_peer_error(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* p = static_cast<Peer*>(arg);
  if (p->failed) return;
  p->failed = true;
  p->impl->events.push_back({LinkEvent::Kind::kPeerFailed, p->id, 0, TransportErrc::kUnavailable,
                             ucx_problem(fmt::format("peer {}", p->id).c_str(), status)});
}

void Link::Impl::close_endpoint(Peer& p) {
  if (p.ep == nullptr) return;
  ucp_request_param_t param{};
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  param.flags = UCP_EP_CLOSE_FLAG_FORCE;  // no flush: what is in flight fails, nothing waits on the peer
  ucs_status_ptr_t req = ucp_ep_close_nbx(p.ep, &param);
  p.ep = nullptr;
  if (req == nullptr || UCS_PTR_IS_ERR(req)) return;
  const std::int64_t deadline = monotonic_ns() + kDrainNs;
  while (ucp_request_check_status(req) == UCS_INPROGRESS && monotonic_ns() < deadline) drive();
  ucp_request_free(req);
}

void Link::Impl::shut_down() {
  if (worker == nullptr) return;
  for (auto& [r, owned] : receives) ucp_request_cancel(worker, owned->request);
  const std::int64_t deadline = monotonic_ns() + kDrainNs;
  while (!receives.empty() && monotonic_ns() < deadline) drive();
  for (auto& [id, p] : peers) close_endpoint(*p);
  drive();
  ucp_worker_destroy(worker);
  worker = nullptr;
  ucp_cleanup(context);
  context = nullptr;
}

Result<std::unique_ptr<Link>, TransportErrc> Link::open(LinkOptions options) {
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  ucp_config_t* config = nullptr;
  if (auto s = ucp_config_read(nullptr, nullptr, &config); s != UCS_OK)
    return make_error(TransportErrc::kUnavailable, ucx_problem("UCX configuration", s));
  ucp_params_t params{};
  params.field_mask = UCP_PARAM_FIELD_FEATURES;
  params.features = UCP_FEATURE_AM;
  const ucs_status_t init = ucp_init(&params, config, &impl->context);
  ucp_config_release(config);
  if (init != UCS_OK) return make_error(TransportErrc::kUnavailable, ucx_problem("UCX init", init));
  ucp_worker_params_t wp{};
  wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  wp.thread_mode = UCS_THREAD_MODE_SINGLE;
  if (auto s = ucp_worker_create(impl->context, &wp, &impl->worker); s != UCS_OK) {
    ucp_cleanup(impl->context);
    impl->context = nullptr;
    return make_error(TransportErrc::kUnavailable, ucx_problem("UCX worker", s));
  }
  ucp_am_handler_param_t hp{};
  hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                  UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
  hp.id = kBlockMessage;
  hp.cb = &Impl::on_block;
  hp.arg = impl.get();
  hp.flags = UCP_AM_FLAG_WHOLE_MSG;
  if (auto s = ucp_worker_set_am_recv_handler(impl->worker, &hp); s != UCS_OK)
    return make_error(TransportErrc::kInternal, ucx_problem("UCX active-message handler", s));
  ucp_address_t* addr = nullptr;
  size_t addr_len = 0;
  if (auto s = ucp_worker_get_address(impl->worker, &addr, &addr_len); s != UCS_OK)
    return make_error(TransportErrc::kInternal, ucx_problem("UCX worker address", s));
  const auto* bytes = reinterpret_cast<const std::byte*>(addr);
  impl->address.assign(bytes, bytes + addr_len);
  ucp_worker_release_address(impl->worker, addr);
  ucp_context_attr_t attr{};
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  if (ucp_context_query(impl->context, &attr) == UCS_OK)
    impl->cuda = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  return std::unique_ptr<Link>(new Link(std::move(impl)));
}

Link::Link(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Link::~Link() = default;

std::span<const std::byte> Link::address() const { return impl_->address; }
bool Link::cuda_memory() const { return impl_->cuda; }
std::string Link::memory_path() const {
  return impl_->cuda ? "UCX registers CUDA memory: device blocks move directly"
                     : "UCX has no CUDA memory support: device blocks move through pinned host staging";
}

Result<std::uint64_t, TransportErrc> Link::connect(std::span<const std::byte> peer_address) {
  if (peer_address.empty()) return make_error(TransportErrc::kInvalidArgument, "an empty peer address");
  auto p = std::make_unique<Impl::Peer>(Impl::Peer{impl_.get(), impl_->next_peer++});
  ucp_ep_params_t ep{};
  ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                  UCP_EP_PARAM_FIELD_ERR_HANDLER;
  ep.address = reinterpret_cast<const ucp_address_t*>(peer_address.data());
  ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
  ep.err_handler.cb = &Impl::on_peer_error;
  ep.err_handler.arg = p.get();
  if (auto s = ucp_ep_create(impl_->worker, &ep, &p->ep); s != UCS_OK)
    return make_error(TransportErrc::kUnavailable, ucx_problem("UCX endpoint to the peer", s));
  const auto id = p->id;
  impl_->peers.emplace(id, std::move(p));
  return id;
}

void Link::disconnect(std::uint64_t peer) {
  const auto it = impl_->peers.find(peer);
  if (it == impl_->peers.end()) return;
  impl_->close_endpoint(*it->second);
  impl_->peers.erase(it);
}

Status<TransportErrc> Link::grant(std::uint64_t grant, std::vector<std::span<std::byte>> blocks,
                                  std::int64_t expires_ns) {
  if (grant == 0) return make_error(TransportErrc::kInvalidArgument, "grant id 0 is reserved");
  if (blocks.empty()) return make_error(TransportErrc::kInvalidArgument, fmt::format("grant {} has no blocks", grant));
  if (impl_->grants.count(grant) != 0)
    return make_error(TransportErrc::kInvalidArgument, fmt::format("grant {} is in use", grant));
  Impl::Grant g;
  g.state.assign(blocks.size(), kOpen);
  g.blocks = std::move(blocks);
  g.expires_ns = expires_ns;
  impl_->grants.emplace(grant, std::move(g));
  return {};
}

Status<TransportErrc> Link::revoke(std::uint64_t grant) {
  const auto it = impl_->grants.find(grant);
  if (it == impl_->grants.end()) return {};
  it->second.revoked = true;  // no new block is accepted from here on
  for (auto& [r, owned] : impl_->receives)
    if (owned->grant == grant) ucp_request_cancel(impl_->worker, owned->request);
  const std::int64_t deadline = monotonic_ns() + kDrainNs;
  while (it->second.in_flight != 0 && monotonic_ns() < deadline) impl_->drive();
  if (it->second.in_flight != 0) {  // the blocks may still be written: the grant stays until they end
    it->second.erase_when_drained = true;
    return make_error(TransportErrc::kUnavailable,
                      fmt::format("grant {}: {} receives still in flight after revoke; its blocks may still be "
                                  "written",
                                  grant, it->second.in_flight));
  }
  impl_->grants.erase(it);
  return {};
}

std::size_t Link::receives_in_flight() const { return impl_->receives.size(); }

std::size_t Link::received(std::uint64_t grant) const {
  const auto it = impl_->grants.find(grant);
  return it == impl_->grants.end() ? 0 : it->second.received;
}

Result<std::uint64_t, TransportErrc> Link::send_block(std::uint64_t peer, std::uint64_t grant, std::uint32_t index,
                                                      std::span<const std::byte> src) {
  const auto it = impl_->peers.find(peer);
  if (it == impl_->peers.end()) return make_error(TransportErrc::kInvalidArgument, fmt::format("no peer {}", peer));
  if (it->second->failed) return make_error(TransportErrc::kUnavailable, fmt::format("peer {} has failed", peer));
  if (src.empty()) return make_error(TransportErrc::kInvalidArgument, "an empty block");
  auto s = std::make_unique<Impl::Send>(Impl::Send{impl_.get(), impl_->next_send++, {}});
  s->header = encode_block_header({grant, index, src.size(), block_checksum(src)});
  ucp_request_param_t p{};
  p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
  p.flags = src.size() >= impl_->options.rndv_bytes ? UCP_AM_SEND_FLAG_RNDV : UCP_AM_SEND_FLAG_EAGER;
  p.cb.send = &Impl::on_sent;
  p.user_data = s.get();
  ucs_status_ptr_t st = ucp_am_send_nbx(it->second->ep, kBlockMessage, s->header.data(), s->header.size(),
                                        src.data(), src.size(), &p);
  const auto id = s->id;
  if (UCS_PTR_IS_ERR(st))
    return make_error(TransportErrc::kUnavailable, ucx_problem(fmt::format("send to peer {}", peer).c_str(),
                                                               UCS_PTR_STATUS(st)));
  if (st == nullptr) {
    impl_->events.push_back({LinkEvent::Kind::kSent, id, 0, TransportErrc::kInternal, {}});
    return id;
  }
  impl_->sends.emplace(id, std::move(s));
  return id;
}

std::size_t Link::sends_in_flight() const { return impl_->sends.size(); }

void Link::progress(std::vector<LinkEvent>& events) {
  impl_->drive();
  for (auto& e : impl_->events) events.push_back(std::move(e));
  impl_->events.clear();
}

}  // namespace kvtd::transport
