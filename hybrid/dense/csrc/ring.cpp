// DDP's gradient all-reduce among CPU trainers, over TCP connections of its own
// (hybrid/dense/ring.py connects them and installs the DDP communication hook).
//
// A gloo all-reduce of one DLRM bucket costs each trainer about 1 ms of CPU under load: its
// worker and event-loop threads trade a dozen wake-ups and many small control messages per
// call. Here one thread per ring (under SCHED_BATCH) does the whole reduction with non-blocking
// sends and receives and a poll per wait: a ring all-reduce (reduce-scatter, then all-gather; 2 (N - 1) / N of the
// buffer each way per trainer, as gloo's ring), in place, float32.
//
// Every rank ends with the same bits: chunk c is summed once, in ring order starting at rank c
// ((x_c + x_c+1) + ...), by the ranks it passes, and then copied to the others. Between two
// trainers every element is x_0 + x_1, what any all-reduce computes.
//
// Each message is a 16-byte header (the connection's message number and the payload's bytes)
// and the payload. A peer that closes its connection or sends what this rank does not expect
// fails the all-reduce at once; one that neither sends nor takes data for `timeout_s` fails it
// after that. The error names the peer and is the future's error (DDP's backward raises it); the
// ring stays failed.
//
// torch.classes.hybrid.Ring(rank, size, left_fd, right_fd, timeout_s, left_name, right_name):
//   the ring takes over both connected sockets (closes them on close()). Messages go to the
//   right neighbour and come from the left one.
// torch.ops.hybrid.ring_allreduce_(ring, buffer, done): queues the sum of `buffer` (float32,
//   contiguous, CPU) over the ring; `done` completes with `buffer` (the Python tensor: DDP takes
//   only a Python value as a hook's result) once it holds the sum, or fails with the error.
// Ring.close(): ends the ring's thread; queued and later all-reduces fail.

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/jit/python/pybind_utils.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace {

struct Header {
  uint64_t seq;
  uint64_t bytes;
};

using Clock = std::chrono::steady_clock;

constexpr const char* kClosed = "ddp all-reduce: the ring is closed";

class Ring : public torch::CustomClassHolder {
 public:
  Ring(int64_t rank, int64_t size, int64_t left_fd, int64_t right_fd, double timeout_s, std::string left_name,
       std::string right_name)
      : rank_(rank), size_(size), left_(static_cast<int>(left_fd)), right_(static_cast<int>(right_fd)),
        timeout_(std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(timeout_s))),
        left_name_(std::move(left_name)), right_name_(std::move(right_name)) {
    TORCH_CHECK(size >= 2 && rank >= 0 && rank < size, "Ring: rank ", rank, " of ", size, " trainers");
    TORCH_CHECK(timeout_s > 0, "Ring: timeout_s must be positive, got ", timeout_s);
    for (int fd : {left_, right_}) {
      const int flags = fcntl(fd, F_GETFL);
      TORCH_CHECK(flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0, "Ring: socket ", fd, ": ",
                  std::strerror(errno));
    }
    thread_ = std::thread([this] { run(); });
  }

  ~Ring() override { close(); }

  void enqueue(at::Tensor buffer, c10::IValue value, c10::intrusive_ptr<c10::ivalue::Future> done) {
    TORCH_CHECK(buffer.device().is_cpu() && buffer.scalar_type() == at::kFloat && buffer.is_contiguous(),
                "ring_allreduce_: the buffer must be a contiguous float32 CPU tensor, got ", buffer.scalar_type(),
                " on ", buffer.device(), buffer.is_contiguous() ? "" : " (not contiguous)");
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (error_.empty() && !stop_) {
        queue_.push_back({std::move(buffer), std::move(value), done});
        cv_.notify_one();
        return;
      }
    }
    done->setError(std::make_exception_ptr(std::runtime_error(failure())));
  }

  void close() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (stop_) return;
      stop_ = true;
      cv_.notify_one();
    }
    // Wakes the thread's poll, if it is in one.
    ::shutdown(left_, SHUT_RDWR);
    ::shutdown(right_, SHUT_RDWR);
    if (thread_.joinable()) {
      // The thread may need the GIL to drop a failed all-reduce's Python value: a caller that
      // holds it (Python, or the object's last reference dropped there) lets go while it waits.
      if (Py_IsInitialized() && PyGILState_Check()) {
        pybind11::gil_scoped_release released;
        thread_.join();
      } else {
        thread_.join();
      }
    }
    ::close(left_);
    ::close(right_);
  }

 private:
  struct Job {
    at::Tensor buffer;
    c10::IValue value;  // `buffer` as a Python object
    c10::intrusive_ptr<c10::ivalue::Future> done;
  };

  std::string failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return failure_locked();
  }

  // Why an all-reduce cannot run: the ring's error, or that it is closed. Under mu_.
  std::string failure_locked() const { return error_.empty() ? std::string(kClosed) : error_; }

  void run() {
    // SCHED_BATCH: the peer's data waking this thread does not preempt the thread running on
    // the core (the trainer's step) but waits its turn, as gloo's event loop does on hybrid's
    // trainers (runtime.gloo_loop_batch); an idle core runs it at once either way. Where the
    // policy cannot be set, the thread runs as started.
    sched_param param{};
    ::sched_setscheduler(0, SCHED_BATCH, &param);
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;
      Job job = std::move(queue_.front());
      queue_.pop_front();
      const bool go = error_.empty() && !stop_;
      lock.unlock();
      std::string error;
      if (go) {
        try {
          allreduce(job.buffer.data_ptr<float>(), job.buffer.numel());
        } catch (const std::exception& e) {
          error = e.what();
        }
      }
      lock.lock();
      if (!error.empty() && error_.empty()) error_ = error;
      if (go && error.empty()) {
        lock.unlock();
        // The storage named: else the future would ask Python for the value's tensors (the GIL).
        job.done->markCompleted(job.value, std::vector<c10::weak_intrusive_ptr<c10::StorageImpl>>{
                                               job.buffer.storage().getWeakStorageImpl()});
      } else {
        const std::string message = failure_locked();
        lock.unlock();
        job.done->setError(std::make_exception_ptr(std::runtime_error(message)));
      }
      lock.lock();
    }
  }

  // Chunk i of n elements: [begin, end).
  std::pair<int64_t, int64_t> chunk(int64_t i, int64_t n) const {
    return {n * i / size_, n * (i + 1) / size_};
  }

  void allreduce(float* data, int64_t n) {
    auto idx = [this](int64_t i) { return ((i % size_) + size_) % size_; };
    int64_t most = 0;
    for (int64_t i = 0; i < size_; ++i) {
      const auto [b, e] = chunk(i, n);
      most = std::max(most, e - b);
    }
    if (static_cast<int64_t>(scratch_.size()) < most) scratch_.resize(most);
    // Reduce-scatter: at step k, send chunk rank - k (summed so far) and add chunk rank - k - 1.
    for (int64_t k = 0; k + 1 < size_; ++k) {
      const auto [sb, se] = chunk(idx(rank_ - k), n);
      const auto [rb, re] = chunk(idx(rank_ - k - 1), n);
      exchange(data + sb, se - sb, scratch_.data(), re - rb);
      float* to = data + rb;
      const float* from = scratch_.data();
      for (int64_t j = 0; j < re - rb; ++j) to[j] += from[j];
    }
    // All-gather: rank holds chunk rank + 1 whole; pass each whole chunk on.
    for (int64_t k = 0; k + 1 < size_; ++k) {
      const auto [sb, se] = chunk(idx(rank_ + 1 - k), n);
      const auto [rb, re] = chunk(idx(rank_ - k), n);
      exchange(data + sb, se - sb, data + rb, re - rb);
    }
  }

  [[noreturn]] static void fail_io(const char* doing, const std::string& who, int err) {
    throw std::runtime_error(std::string("ddp all-reduce: ") + doing + " " + who + " failed: " + std::strerror(err) +
                             " (it ended or failed)");
  }

  // Sends `out` (n_out floats) to the right while receiving n_in floats from the left into `in`.
  void exchange(const float* out, int64_t n_out, float* in, int64_t n_in) {
    Header head_out{sent_, static_cast<uint64_t>(n_out) * sizeof(float)};
    Header head_in{};
    const size_t out_total = sizeof(Header) + head_out.bytes;
    const size_t in_bytes = static_cast<size_t>(n_in) * sizeof(float);
    const size_t in_total = sizeof(Header) + in_bytes;
    size_t sent = 0, got = 0;
    auto deadline = Clock::now() + timeout_;
    while (sent < out_total || got < in_total) {
      bool progress = false;
      if (sent < out_total) {
        iovec iov[2];
        int parts = 0;
        if (sent < sizeof(Header)) {
          iov[parts++] = {reinterpret_cast<char*>(&head_out) + sent, sizeof(Header) - sent};
          iov[parts++] = {const_cast<float*>(out), head_out.bytes};
        } else {
          iov[parts++] = {reinterpret_cast<char*>(const_cast<float*>(out)) + (sent - sizeof(Header)),
                          out_total - sent};
        }
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = parts;
        const ssize_t r = ::sendmsg(right_, &msg, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (r > 0) {
          sent += static_cast<size_t>(r);
          progress = true;
        } else if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          fail_io("sending to", right_name_, errno);
        }
      }
      if (got < in_total) {
        iovec iov[2];
        int parts = 0;
        if (got < sizeof(Header)) {
          iov[parts++] = {reinterpret_cast<char*>(&head_in) + got, sizeof(Header) - got};
          iov[parts++] = {in, in_bytes};
        } else {
          iov[parts++] = {reinterpret_cast<char*>(in) + (got - sizeof(Header)), in_total - got};
        }
        msghdr msg{};
        msg.msg_iov = iov;
        msg.msg_iovlen = parts;
        const ssize_t r = ::recvmsg(left_, &msg, MSG_DONTWAIT);
        if (r > 0) {
          const bool had_header = got >= sizeof(Header);
          got += static_cast<size_t>(r);
          progress = true;
          if (!had_header && got >= sizeof(Header) && (head_in.seq != received_ || head_in.bytes != in_bytes)) {
            throw std::runtime_error(
                "ddp all-reduce: " + left_name_ + " sent message " + std::to_string(head_in.seq) + " of " +
                std::to_string(head_in.bytes) + " bytes where message " + std::to_string(received_) + " of " +
                std::to_string(in_bytes) + " was due: the trainers' gradient buckets differ");
          }
        } else if (r == 0) {
          throw std::runtime_error("ddp all-reduce: " + left_name_ +
                                   " closed its connection (it ended or failed)");
        } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          fail_io("reading from", left_name_, errno);
        }
      }
      if (progress) {
        deadline = Clock::now() + timeout_;
        continue;
      }
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (stop_) throw std::runtime_error(kClosed);
      }
      pollfd fds[2];
      nfds_t k = 0;
      if (got < in_total) fds[k++] = {left_, POLLIN, 0};
      if (sent < out_total) fds[k++] = {right_, POLLOUT, 0};
      const auto left_ms = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      if (left_ms <= 0) {
        const double s = std::chrono::duration<double>(timeout_).count();
        if (got < in_total) {
          throw std::runtime_error("ddp all-reduce: " + left_name_ + " sent nothing for " + c10::str(s) +
                                   " s (runtime.pg_timeout_s); it is hung or stopped");
        }
        throw std::runtime_error("ddp all-reduce: " + right_name_ + " took nothing for " + c10::str(s) +
                                 " s (runtime.pg_timeout_s); it is hung or stopped");
      }
      const int ready = ::poll(fds, k, static_cast<int>(std::min<int64_t>(left_ms + 1, 1000)));
      if (ready < 0 && errno != EINTR) throw std::runtime_error(std::string("ddp all-reduce: poll: ") + std::strerror(errno));
    }
    ++sent_;
    ++received_;
  }

  const int64_t rank_, size_;
  const int left_, right_;
  const Clock::duration timeout_;
  const std::string left_name_, right_name_;
  uint64_t sent_ = 0, received_ = 0;  // messages, on the ring's thread only
  std::vector<float> scratch_;        // the chunk being received in the reduce-scatter
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  std::string error_;
  bool stop_ = false;
  std::thread thread_;
};

// Boxed: the schema's Future(Tensor) has no unboxed C++ argument type.
void ring_allreduce_(const c10::OperatorHandle&, torch::jit::Stack* stack) {
  auto done = torch::jit::pop(*stack).toFuture();
  auto buffer = torch::jit::pop(*stack).toTensor();
  auto ring = torch::jit::pop(*stack).toCustomClass<Ring>();
  c10::IValue value;
  {
    pybind11::gil_scoped_acquire gil;
    value = torch::jit::toIValue(torch::jit::toPyObject(c10::IValue(buffer)), c10::PyObjectType::get());
  }
  ring->enqueue(std::move(buffer), std::move(value), std::move(done));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid, m) {
  m.class_<Ring>("Ring")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, double, std::string, std::string>())
      .def("close", &Ring::close);
  m.def("ring_allreduce_(__torch__.torch.classes.hybrid.Ring ring, Tensor(a!) buffer, Future(Tensor) done) -> ()");
}

TORCH_LIBRARY_IMPL(hybrid, CatchAll, m) {
  m.impl("ring_allreduce_", torch::CppFunction::makeFromBoxedFunction<&ring_allreduce_>());
}
