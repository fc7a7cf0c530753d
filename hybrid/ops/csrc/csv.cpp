// csv_records_end: where the last record of a block of CSV bytes ends, read as pyarrow's parser
// reads it (comma-separated, '"' quotes fields, "" a quote inside one, no escape character).
//
// A CSV reader hands pyarrow the file a block at a time (hybrid/data/tabular.py:
// arrow_csv_batches), each block ending where a record ends, so that every block's start is a
// place a resumed run can seek to. A line break inside a quoted field does not end a record;
// whether a quote opens a field depends on everything before it, so the block is scanned once
// from its start (which starts a record). The plain-Python twin is
// hybrid.ops.reference.csv_records_end.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

namespace {

using at::Tensor;

// pyarrow's parser: a quote opens a field only at the field's start; in a quoted field every
// byte (line breaks too) is the field's up to a quote, which either doubles (a quote inside)
// or closes it; after the closing quote the field goes on unquoted (pyarrow keeps what follows)
// to a comma or a line break. '\r' ends a line too ('\r\n' is one line break and an empty line
// to pyarrow, which skips empty lines), but only a '\n' ends a block, so that lines are counted
// by '\n'.
enum class State { kFieldStart, kUnquoted, kQuoted, kAfterQuote };

// `text`: uint8 bytes starting where a record starts. Returns the offset just past the last
// '\n' that ends a record, or -1 when no record ends in `text`.
int64_t csv_records_end(const Tensor& text) {
  TORCH_CHECK_TYPE(text.scalar_type() == at::kByte, "text must be uint8; got ", text.scalar_type());
  TORCH_CHECK_VALUE(text.dim() == 1 && text.is_contiguous() && text.device().is_cpu(),
                    "text must be a contiguous 1-D CPU tensor");
  const auto* data = text.data_ptr<uint8_t>();
  const int64_t size = text.numel();
  State s = State::kFieldStart;
  int64_t end = -1;
  for (int64_t i = 0; i < size; ++i) {
    const uint8_t c = data[i];
    switch (s) {
      case State::kQuoted: {
        const void* q = memchr(data + i, '"', static_cast<size_t>(size - i));
        if (q == nullptr) return end;  // the rest is inside the quotes
        i = static_cast<const uint8_t*>(q) - data;
        s = State::kAfterQuote;
        break;
      }
      case State::kAfterQuote:
        if (c == '"') {
          s = State::kQuoted;  // "" : a quote inside the field
          break;
        }
        [[fallthrough]];
      case State::kUnquoted:
        if (c == ',' || c == '\r') {
          s = State::kFieldStart;
        } else if (c == '\n') {
          s = State::kFieldStart;
          end = i + 1;
        } else {
          s = State::kUnquoted;
        }
        break;
      case State::kFieldStart:
        if (c == '"') {
          s = State::kQuoted;
        } else if (c == '\n') {
          end = i + 1;
        } else if (c != ',' && c != '\r') {
          s = State::kUnquoted;
        }
        break;
    }
  }
  return end;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(hybrid, m) { m.def("csv_records_end(Tensor text) -> int"); }

TORCH_LIBRARY_IMPL(hybrid, CPU, m) { m.impl("csv_records_end", csv_records_end); }
