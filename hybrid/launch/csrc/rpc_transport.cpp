// The TensorPipe transport `hybrid_uv`: TensorPipe's TCP transport (`uv`), listening on the
// address in $HYBRID_RPC_ADDRESS (a numeric IPv4 or IPv6 address) instead of the first address
// of an interface. torch picks `uv`'s listening address from $TP_SOCKET_IFNAME or the hostname
// only, so 127.0.0.2 or ::1 on `lo` cannot be chosen there. hybrid.launch.address sets the
// variable from `runtime.address` and names this transport in the RPC options; loading
// hybrid._C registers it (a static registerer, as torch registers its own transports). Its
// priority is one below `uv`'s: an agent started without a transport list (plain
// `rpc.init_rpc` in a process that loaded hybrid._C) registers every transport of the registry
// with its own priority, and TensorPipe refuses two with the same one. `uv` is then preferred;
// hybrid names its transports, and their order sets the priorities.
#if __has_include(<tensorpipe/transport/uv/factory.h>)
#define USE_TENSORPIPE 1
#include <cstdlib>
#include <memory>
#include <string>

#include <tensorpipe/transport/uv/factory.h>
#include <torch/csrc/distributed/rpc/tensorpipe_agent.h>

namespace torch::distributed::rpc {
namespace {

std::unique_ptr<TransportRegistration> makeHybridUvTransport() {
  const char* address = std::getenv("HYBRID_RPC_ADDRESS");
  return std::make_unique<TransportRegistration>(TransportRegistration{
      tensorpipe::transport::uv::create(), kUvTransportPriority - 1,
      std::string(address != nullptr && *address != '\0' ? address : "127.0.0.1")});
}

}  // namespace

C10_REGISTER_CREATOR(TensorPipeTransportRegistry, hybrid_uv, makeHybridUvTransport)

}  // namespace torch::distributed::rpc
#endif
