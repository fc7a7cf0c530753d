// criteo_parse: the lines of a Criteo TSV chunk as tensors, in one pass over the bytes.
//
// Every trainer reads every line of the training files (hybrid/data/tabular.py: all must agree
// on which lines are malformed), so the parse of a line is paid once per trainer; here it costs
// a pass over the line's bytes instead of a regular expression and Python objects per field.
// What a line means is documented in hybrid/data/criteo.py; the plain-Python twin is
// hybrid.ops.reference.criteo_parse.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

using at::Tensor;

constexpr int kDense = 13;
constexpr int kSparse = 26;
constexpr int kFields = 1 + kDense + kSparse;
constexpr int64_t kBig = int64_t{1} << 62;

// Each byte's hex digit value, or -1.
constexpr std::array<int8_t, 256> kHex = [] {
  std::array<int8_t, 256> t{};
  for (int c = 0; c < 256; ++c) {
    t[c] = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
  }
  return t;
}();

// One line [p, end) (its trailing '\r's already cut), in one forward pass: writes label, dense
// and ids and returns true, or returns false for a malformed line (the caller names what is
// wrong). A field ends at a tab; the last one at the end of the line.
bool parse_line(const uint8_t* p, const uint8_t* end, const int64_t* rows, float* label,
                int64_t* dense, int64_t* ids) {
  if (end - p < 2 || (p[0] != '0' && p[0] != '1') || p[1] != '\t') return false;
  *label = p[0] == '1' ? 1.0f : 0.0f;
  p += 2;
  for (int j = 0; j < kDense; ++j) {
    const uint8_t* q = p;
    int64_t v = 0;
    bool negative = false;
    if (q < end && (*q == '+' || *q == '-')) {
      negative = *q++ == '-';
      if (q == end || *q < '0' || *q > '9') return false;  // a sign without digits
    }
    for (; q < end && *q != '\t'; ++q) {
      const int digit = *q - '0';
      if (digit < 0 || digit > 9) return false;
      v = v > (kBig - digit) / 10 ? kBig : v * 10 + digit;  // every value above 2**62 counts as it
    }
    if (q == end) return false;  // fewer fields
    p = q + 1;                   // past the tab
    dense[j] = negative ? 0 : v;
  }
  for (int j = 0; j < kSparse; ++j) {
    // The value modulo the table's rows, for any number of digits: the first 15 accumulate
    // exactly (below 2**60), each further one is reduced in 128 bits; at most one division
    // in the common case (8 digits).
    const auto m = static_cast<uint64_t>(rows[j]);
    const uint8_t* q = p;
    const uint8_t* exact_end = end - q > 15 ? q + 15 : end;
    uint64_t v = 0;
    for (; q < exact_end && *q != '\t'; ++q) {
      const int d = kHex[*q];
      if (d < 0) return false;
      v = v * 16 + static_cast<uint64_t>(d);
    }
    for (; q < end && *q != '\t'; ++q) {
      const int d = kHex[*q];
      if (d < 0) return false;
      v = static_cast<uint64_t>((static_cast<unsigned __int128>(v) * 16 + static_cast<unsigned>(d)) % m);
    }
    ids[j] = static_cast<int64_t>(v < m ? v : v % m);
    if (j < kSparse - 1) {
      if (q == end) return false;  // fewer fields
      p = q + 1;
    } else if (q != end) {
      return false;  // more fields
    }
  }
  return true;
}

// `text`: uint8 bytes of whole lines, each ending at '\n' (the last may lack it); trailing '\r's
// of a line are ignored; an empty line is a line (malformed). `rows`: the 26 tables' rows.
// Returns per line: status (int8: 0 good, 1 malformed), label (float32), dense (int64 [n, 13],
// blank and negative 0, at most 2**62), ids (int64 [n, 26], the hex value modulo the table's
// rows, blank 0). A malformed line's label, dense and ids are 0.
std::tuple<Tensor, Tensor, Tensor, Tensor> criteo_parse(const Tensor& text, at::IntArrayRef rows) {
  TORCH_CHECK_TYPE(text.scalar_type() == at::kByte, "text must be uint8; got ", text.scalar_type());
  TORCH_CHECK_VALUE(text.dim() == 1 && text.is_contiguous() && text.device().is_cpu(),
                    "text must be a contiguous 1-D CPU tensor");
  TORCH_CHECK_VALUE(static_cast<int>(rows.size()) == kSparse, "rows must hold ", kSparse,
                    " tables' rows; got ", rows.size());
  for (const int64_t r : rows) TORCH_CHECK_VALUE(r > 0, "rows must be positive; got ", r);
  const auto* data = text.data_ptr<uint8_t>();
  const int64_t size = text.numel();
  std::vector<int64_t> starts;
  starts.reserve(static_cast<size_t>(size / 128 + 1));
  for (int64_t i = 0; i < size;) {
    starts.push_back(i);
    const void* nl = memchr(data + i, '\n', static_cast<size_t>(size - i));
    i = nl ? static_cast<const uint8_t*>(nl) - data + 1 : size;
  }
  const auto n = static_cast<int64_t>(starts.size());
  starts.push_back(size);
  auto status = at::zeros({n}, at::kChar);
  auto labels = at::zeros({n}, at::kFloat);
  auto dense = at::zeros({n, kDense}, at::kLong);
  auto ids = at::zeros({n, kSparse}, at::kLong);
  auto* st = status.data_ptr<int8_t>();
  auto* lab = labels.data_ptr<float>();
  auto* den = dense.data_ptr<int64_t>();
  auto* idp = ids.data_ptr<int64_t>();
  const int64_t* rp = rows.data();
  at::parallel_for(0, n, 256, [&](int64_t lo, int64_t hi) {
    int64_t d[kDense];
    int64_t s[kSparse];
    for (int64_t i = lo; i < hi; ++i) {
      const uint8_t* p = data + starts[i];
      const uint8_t* e = data + starts[i + 1];
      if (e > p && e[-1] == '\n') --e;
      while (e > p && e[-1] == '\r') --e;
      float y = 0;
      if (!parse_line(p, e, rp, &y, d, s)) {
        st[i] = 1;
        continue;
      }
      lab[i] = y;
      std::copy(d, d + kDense, den + i * kDense);
      std::copy(s, s + kSparse, idp + i * kSparse);
    }
  });
  return {status, labels, dense, ids};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid, m) {
  m.def("criteo_parse(Tensor text, int[] rows) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(hybrid, CPU, m) { m.impl("criteo_parse", criteo_parse); }
