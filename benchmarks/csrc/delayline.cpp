// The emulated network's delay line (benchmarks/delayline.py drives it): frames read from the
// switch's ports and sent on to their host `delay` after the kernel received them.
//
// It is native because it runs on the cores the emulated hosts share: its work per frame is CPU
// taken from the systems being timed, which a real switch does not take. Per frame it does one
// recvmsg (the frame and its SO_TIMESTAMPNS receive time), one send, and a few loads and
// stores; the waits are ppoll calls with a nanosecond timeout.
//
// torch.classes.hybrid_bench.DelayLine(port_fds, port_macs, delay_s):
//   run(control_fd) -> int   forwards frames until control_fd is readable or at end of file (1;
//                            the caller reads which) or a signal arrives (2: the caller's Python
//                            handlers run, then it calls run again). Frames not yet due stay
//                            queued between calls.
//   take() -> Tensor         int64 [frames, bytes, dropped, lead_ns, held_us[0..HELD_MAX_US]]
//                            since the last take: frames and bytes forwarded, frames lost (no
//                            port for their MAC, truncated, without a receive time, or a port
//                            down or full), the current lead, and how many frames stayed each
//                            whole number of microseconds (the last counts HELD_MAX_US or more).

#include <Python.h>

#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <deque>
#include <memory>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <time.h>
#include <unordered_map>
#include <vector>

namespace {

constexpr int64_t kVnetHdr = 10;                               // virtio_net_hdr before the Ethernet header
constexpr size_t kFrameMax = kVnetHdr + 14 + 65535 + 64;       // the largest offload frame
constexpr int64_t kHeldMaxUs = 100000;
constexpr int kReadsPerWake = 64;                              // frames read from one port before the others
constexpr int64_t kLateMaxNs = 100000;                         // the most one late wait counts in the lead

int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);  // the clock SO_TIMESTAMPNS stamps frames with
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t mac_of(const uint8_t* p) {
  int64_t m = 0;
  for (int i = 0; i < 6; i++) m = (m << 8) | p[i];
  return m;
}

using Buffer = std::unique_ptr<uint8_t[]>;  // kFrameMax bytes

// SIGTERM and SIGINT blocked for the object's life; `outside` is the mask as it was.
struct SignalsHeld {
  sigset_t outside;
  SignalsHeld() {
    sigset_t block;
    sigemptyset(&block);
    sigaddset(&block, SIGTERM);
    sigaddset(&block, SIGINT);
    pthread_sigmask(SIG_BLOCK, &block, &outside);
  }
  ~SignalsHeld() { pthread_sigmask(SIG_SETMASK, &outside, nullptr); }
};

struct Held {
  int64_t due_ns, received_ns;
  int out_fd;
  size_t size;
  Buffer frame;
};

class DelayLine : public torch::CustomClassHolder {
 public:
  DelayLine(std::vector<int64_t> port_fds, std::vector<int64_t> port_macs, double delay_s)
      : delay_ns_(static_cast<int64_t>(delay_s * 1e9)), held_(kHeldMaxUs + 1, 0) {
    TORCH_CHECK_VALUE(!port_fds.empty() && port_fds.size() == port_macs.size(),
                      "one MAC address per port, and at least one port");
    TORCH_CHECK_VALUE(delay_s >= 0, "the delay must be >= 0, got ", delay_s);
    for (size_t i = 0; i < port_fds.size(); i++) {
      ports_.push_back(static_cast<int>(port_fds[i]));
      by_mac_[port_macs[i]] = static_cast<int>(port_fds[i]);
    }
  }

  int64_t run(int64_t control_fd) {
    // SIGTERM and SIGINT are blocked but while ppoll waits: one that comes while frames are
    // read or sent waits for the next ppoll, which it ends at once, rather than being missed by
    // a wait that starts after its handler's flag was set.
    SignalsHeld signals;
    std::vector<pollfd> fds(ports_.size() + 1);
    fds[0] = {static_cast<int>(control_fd), POLLIN, 0};
    for (size_t i = 0; i < ports_.size(); i++) fds[i + 1] = {ports_[i], POLLIN, 0};
    while (true) {
      timespec timeout{};
      timespec* wait = nullptr;  // nothing queued: wait for a frame or the control pipe
      int64_t asked = now_ns();
      int64_t ahead = 0;
      if (!queue_.empty()) {
        ahead = std::max<int64_t>(0, queue_.front().due_ns - asked - static_cast<int64_t>(lead_ns_));
        timeout.tv_sec = ahead / 1000000000;
        timeout.tv_nsec = ahead % 1000000000;
        wait = &timeout;
      }
      const int ready = ppoll(fds.data(), fds.size(), wait, &signals.outside);
      if (ready < 0) {
        if (errno == EINTR) return 2;
        TORCH_CHECK(false, "the delay line's ppoll failed: ", std::strerror(errno));
      }
      if (ready == 0 && ahead > 0) {
        // Waking takes time (tens of microseconds in a virtual machine): lead is the measured
        // lateness of waking, a moving average; the wait asks to end that much before the next
        // frame's time and what is due within half of it leaves at once. A sample counts at most
        // kLateMaxNs (a core taken away for a millisecond is not how long waking takes), and the
        // lead at most half the delay: past that, a wait would end at once and nothing would
        // measure it again.
        const int64_t late = std::min<int64_t>(now_ns() - asked - ahead, kLateMaxNs);
        lead_ns_ += (static_cast<double>(late) - lead_ns_) * 0.05;
        lead_ns_ = std::clamp(lead_ns_, 0.0, static_cast<double>(delay_ns_) / 2);
      }
      if (fds[0].revents) return 1;  // a request, or end of file: the caller reads which
      for (size_t i = 1; i < fds.size(); i++)
        if (fds[i].revents) read_port(fds[i].fd);
      send_due();
    }
  }

  at::Tensor take() {
    at::Tensor out = at::empty({4 + kHeldMaxUs + 1}, at::kLong);
    int64_t* p = out.data_ptr<int64_t>();
    p[0] = frames_;
    p[1] = bytes_;
    p[2] = dropped_;
    p[3] = static_cast<int64_t>(lead_ns_);
    std::memcpy(p + 4, held_.data(), held_.size() * sizeof(int64_t));
    frames_ = bytes_ = dropped_ = 0;
    std::fill(held_.begin(), held_.end(), 0);
    return out;
  }

 private:
  Buffer buffer() {
    if (spare_.empty()) return Buffer(new uint8_t[kFrameMax]);
    Buffer b = std::move(spare_.back());
    spare_.pop_back();
    return b;
  }

  void read_port(int fd) {
    alignas(cmsghdr) char control[64];
    for (int k = 0; k < kReadsPerWake; k++) {
      Buffer frame = buffer();
      iovec iov{frame.get(), kFrameMax};
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = control;
      msg.msg_controllen = sizeof(control);
      const ssize_t n = ::recvmsg(fd, &msg, MSG_DONTWAIT);
      if (n < 0) {
        spare_.push_back(std::move(frame));
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EINTR) continue;
        dropped_++;  // the port went down (a fault a test injects): nothing to read
        return;
      }
      int64_t received = -1;
      for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c != nullptr; c = CMSG_NXTHDR(&msg, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_TIMESTAMPNS) {
          timespec ts;
          std::memcpy(&ts, CMSG_DATA(c), sizeof(ts));
          received = static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
        }
      auto out = n >= kVnetHdr + 6 ? by_mac_.find(mac_of(frame.get() + kVnetHdr)) : by_mac_.end();
      if (out == by_mac_.end() || (msg.msg_flags & MSG_TRUNC) || received < 0) {
        dropped_++;
        spare_.push_back(std::move(frame));
        continue;
      }
      queue_.push_back(Held{received + delay_ns_, received, out->second, static_cast<size_t>(n), std::move(frame)});
    }
  }

  void send_due() {
    if (queue_.empty()) return;
    const int64_t now = now_ns();
    const int64_t due = now + static_cast<int64_t>(lead_ns_ / 2);
    while (!queue_.empty() && queue_.front().due_ns <= due) {
      Held& h = queue_.front();
      const ssize_t sent = ::send(h.out_fd, h.frame.get(), h.size, MSG_DONTWAIT);
      if (sent < 0) {
        dropped_++;  // the port is down or its queue full: the frame is lost, as on a wire
      } else {
        const int64_t us = std::max<int64_t>(0, (now - h.received_ns) / 1000);
        held_[std::min(kHeldMaxUs, us)]++;
        frames_++;
        bytes_ += static_cast<int64_t>(h.size) - kVnetHdr;
      }
      if (spare_.size() < 256) spare_.push_back(std::move(h.frame));
      queue_.pop_front();
    }
  }

  const int64_t delay_ns_;
  std::vector<int> ports_;
  std::unordered_map<int64_t, int> by_mac_;
  std::deque<Held> queue_;  // in arrival order, which is due order: every frame waits the same
  std::vector<Buffer> spare_;  // buffers of frames sent, for the next ones
  double lead_ns_ = 0.0;
  int64_t frames_ = 0, bytes_ = 0, dropped_ = 0;
  std::vector<int64_t> held_;
};

}  // namespace

TORCH_LIBRARY(hybrid_bench, m) {
  m.class_<DelayLine>("DelayLine")
      .def(torch::init<std::vector<int64_t>, std::vector<int64_t>, double>())
      .def("run", &DelayLine::run)
      .def("take", &DelayLine::take);
}

// `import benchmarks._C` loads this library, which registers the class above.
extern "C" PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  return PyModule_Create(&module_def);
}
