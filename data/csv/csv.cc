#include "data/csv/csv.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <system_error>
#include <utility>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/ascii.h"
#include "absl/strings/charconv.h"
#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/types/span.h"
#include "common/status_macros.h"

namespace psflow::data {
namespace {

constexpr size_t kReadBytes = size_t{4} << 20;
constexpr char kWildcard[] = "*";

constexpr ColumnType kAllTypes[] = {ColumnType::kLabel,       ColumnType::kNumeric,
                                    ColumnType::kCategorical, ColumnType::kCategoricalHex,
                                    ColumnType::kText,        ColumnType::kIgnore};

// Names in an error message, at most ten of them.
std::string NameList(const std::vector<std::string>& names) {
  constexpr size_t kShown = 10;
  if (names.size() <= kShown) return absl::StrJoin(names, ", ");
  return absl::StrCat(absl::StrJoin(names.begin(), names.begin() + kShown, ", "), " and ",
                      names.size() - kShown, " more");
}

// A field's value in an error message: escaped (one line) and cut short.
std::string Quoted(absl::string_view value) {
  constexpr size_t kShown = 40;
  if (value.size() <= kShown) return absl::StrCat("\"", absl::CHexEscape(value), "\"");
  return absl::StrCat("\"", absl::CHexEscape(value.substr(0, kShown)), "\"...");
}

// The checks ParseColumns makes, shared by a format built by hand.
absl::Status ValidateColumns(const std::vector<CsvColumn>& columns, bool allow_wildcard) {
  absl::flat_hash_set<absl::string_view> names;
  int labels = 0;
  for (const CsvColumn& column : columns) {
    if (column.name.empty()) return absl::InvalidArgumentError("column spec: a column has no name");
    if (!names.insert(column.name).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("column spec: column ", column.name, " is named twice"));
    }
    if (column.name == kWildcard) {
      if (!allow_wildcard) {
        return absl::InvalidArgumentError(
            "column spec: \"*\" (the columns not listed) needs a header to name them");
      }
      if (column.type == ColumnType::kLabel) {
        return absl::InvalidArgumentError("column spec: \"*\" cannot be the label");
      }
    }
    if (column.type == ColumnType::kLabel) ++labels;
  }
  if (labels != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("column spec: ", labels, " label columns, need exactly one"));
  }
  return absl::OkStatus();
}

// Where one record lies in a buffer: the fields as offsets from its start,
// quotes excluded, and how far it runs.
struct FieldSpan {
  size_t begin = 0, end = 0;
  bool doubled_quotes = false;  // holds "" that stand for "
};
struct Scan {
  std::vector<FieldSpan> fields;
  size_t consumed = 0;      // bytes of the record and its line end
  int64_t line_breaks = 0;  // LFs consumed, quoted ones included
  std::string error;        // on kError, at line_breaks LFs past the record's first line
};
enum class ScanResult { kRecord, kNeedMore, kError };

// A record of no quote: split at each delimiter, one CR dropped before the LF.
// Eight bytes at a time where bytes are little-endian: a byte loop's branch
// mispredicts at each of a click log's short fields (CountRows took a fifth
// longer with it).
void SplitPlain(const char* data, const char* line_end, char delimiter, Scan* scan) {
  if (line_end > data && line_end[-1] == '\r') --line_end;
  const size_t size = line_end - data;
  size_t begin = 0, i = 0;
  // Member by member: a FieldSpan built aside and copied in stalled on store
  // forwarding (a third of CountRows' time).
  auto cut = [&](size_t at) {
    FieldSpan& field = scan->fields.emplace_back();
    field.begin = begin;
    field.end = at;
    begin = at + 1;
  };
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
  constexpr uint64_t kLow7 = 0x7f7f7f7f7f7f7f7fULL;
  const uint64_t pattern = 0x0101010101010101ULL * static_cast<uint8_t>(delimiter);
  for (; i + 8 <= size; i += 8) {
    uint64_t word;
    std::memcpy(&word, data + i, 8);
    const uint64_t x = word ^ pattern;  // a zero byte where the delimiter is
    // The high bit of each zero byte of x, exactly (no borrow between bytes).
    uint64_t zeros = ~(((x & kLow7) + kLow7) | x | kLow7);
    for (; zeros != 0; zeros &= zeros - 1) cut(i + (__builtin_ctzll(zeros) >> 3));
  }
#endif
  for (; i < size; ++i) {
    if (data[i] == delimiter) cut(i);
  }
  cut(size);
}

// The RFC 4180 state machine, for a record with a quote somewhere in its first
// line. Reads without writing, so a record cut by the buffer's end can be
// scanned again once more is read.
class QuotedScanner {
 public:
  QuotedScanner(const char* data, char delimiter, Scan* scan)
      : data_(data), field_(data), delimiter_(delimiter), scan_(scan) {}

  // Takes the byte at p: true once it ends the record or is an error, which
  // *result then tells apart.
  bool Step(const char* p, ScanResult* result) {
    const char c = *p;
    switch (state_) {
      case kStart:
        if (c == '"') {
          state_ = kQuoted;
          field_ = p + 1;
          quote_line_ = breaks_;
        } else if (c == delimiter_ || c == '\n') {
          EndField(p, p + 1);
        } else {
          state_ = kPlain;
          field_ = p;
        }
        break;
      case kPlain:
        if (c == delimiter_ || c == '\n') {
          EndField(c == '\n' && p > field_ && p[-1] == '\r' ? p - 1 : p, p + 1);
        } else if (c == '"') {
          return Fail(result, breaks_,
                      "a quote inside an unquoted field (quote the whole field and write the "
                      "quote twice)");
        }
        break;
      case kQuoted:
        if (c == '"') state_ = kClosed;
        if (c == '\n') ++breaks_;
        break;
      case kClosed:
        if (c == '"') {
          doubled_ = true;
          state_ = kQuoted;
        } else if (c == delimiter_ || c == '\n') {
          EndField(p - 1, p + 1);
        } else if (c == '\r') {
          state_ = kClosedCr;
        } else {
          return Fail(result, breaks_, kAfterQuote);
        }
        break;
      case kClosedCr:
        if (c != '\n') return Fail(result, breaks_, kAfterQuote);
        EndField(p - 2, p + 1);
        break;
    }
    if (c != '\n' || state_ != kStart) return false;
    scan_->consumed = p + 1 - data_;
    scan_->line_breaks = breaks_ + 1;
    *result = ScanResult::kRecord;
    return true;
  }

  // The file ends the record without a line break.
  ScanResult AtEof(const char* end) {
    ScanResult result = ScanResult::kRecord;
    switch (state_) {
      case kStart:
        EndField(end, end);
        break;
      case kPlain:
        EndField(end > field_ && end[-1] == '\r' ? end - 1 : end, end);
        break;
      case kQuoted:
        Fail(&result, quote_line_, "unterminated quote (the field runs to the end of the file)");
        return result;
      case kClosed:
        EndField(end - 1, end);
        break;
      case kClosedCr:
        EndField(end - 2, end);
        break;
    }
    scan_->consumed = end - data_;
    scan_->line_breaks = breaks_;
    return result;
  }

 private:
  static constexpr char kAfterQuote[] =
      "a character after its closing quote (a quote inside a quoted field is written twice)";

  // Ends the field at field_end; the next one (if any) starts at next.
  void EndField(const char* field_end, const char* next) {
    scan_->fields.push_back({size_t(field_ - data_), size_t(field_end - data_), doubled_});
    doubled_ = false;
    state_ = kStart;
    field_ = next;
  }

  bool Fail(ScanResult* result, int64_t line_breaks, absl::string_view what) {
    scan_->line_breaks = line_breaks;
    scan_->error = absl::StrCat("field ", scan_->fields.size() + 1, ": ", what);
    *result = ScanResult::kError;
    return true;
  }

  enum State { kStart, kPlain, kQuoted, kClosed, kClosedCr } state_ = kStart;
  const char* const data_;
  const char* field_;  // where the current field's text begins
  const char delimiter_;
  Scan* const scan_;
  bool doubled_ = false;
  int64_t breaks_ = 0;      // LFs so far, all quoted
  int64_t quote_line_ = 0;  // breaks_ where the open quote was
};

ScanResult ScanQuoted(const char* data, const char* end, bool eof, char delimiter, Scan* scan) {
  QuotedScanner scanner(data, delimiter, scan);
  ScanResult result;
  for (const char* p = data; p < end; ++p) {
    if (scanner.Step(p, &result)) return result;
  }
  return eof ? scanner.AtEof(end) : ScanResult::kNeedMore;
}

// Finds the record that starts at data. kNeedMore: it may run past size bytes
// and the file has more.
ScanResult ScanRecord(const char* data, size_t size, bool eof, char delimiter, Scan* scan) {
  scan->fields.clear();
  const char* end = data + size;
  const char* newline = static_cast<const char*>(std::memchr(data, '\n', size));
  if (newline == nullptr && !eof) return ScanResult::kNeedMore;
  const char* line_end = newline ? newline : end;
  if (std::memchr(data, '"', line_end - data) != nullptr) {
    return ScanQuoted(data, end, eof, delimiter, scan);
  }
  SplitPlain(data, line_end, delimiter, scan);
  scan->consumed = newline ? newline + 1 - data : size;
  scan->line_breaks = newline ? 1 : 0;
  return ScanResult::kRecord;
}

// An empty line, or one of just CR: no field at all, not one empty field.
bool IsBlank(const char* data, const Scan& scan) {
  return scan.fields.size() == 1 && scan.fields[0].begin == scan.fields[0].end && data[0] != '"';
}

// The fields as views into data, "" undone in place (the text only shrinks).
void MakeViews(char* data, const Scan& scan, std::vector<absl::string_view>* fields) {
  fields->clear();
  for (const FieldSpan& span : scan.fields) {
    char* begin = data + span.begin;
    const char* end = data + span.end;
    if (!span.doubled_quotes) {
      fields->emplace_back(begin, end - begin);
      continue;
    }
    char* out = begin;
    for (const char* in = begin; in < end; ++in) {
      *out++ = *in;
      if (*in == '"') ++in;
    }
    fields->emplace_back(begin, out - begin);
  }
}

// Spaces around a number; a field without them (the common case) costs two tests.
absl::string_view Trim(absl::string_view text) {
  if (text.empty() || (!absl::ascii_isspace(text.front()) && !absl::ascii_isspace(text.back()))) {
    return text;
  }
  return absl::StripAsciiWhitespace(text);
}

bool ParseLabel(absl::string_view text, int64_t* label) {
  text = Trim(text);
  if (text.empty()) return false;
  int64_t value = 0;
  for (const char c : text) {
    if (c < '0' || c > '9') return false;
    if (value > (INT64_MAX - (c - '0')) / 10) return false;
    value = value * 10 + (c - '0');
  }
  *label = value;
  return true;
}

// A float by from_chars (exact, no locale), a leading '+' allowed; a value
// below float's range is 0, one above it or not finite is refused.
bool ParseFloat(absl::string_view text, float* value) {
  if (!text.empty() && text[0] == '+') {
    text.remove_prefix(1);
    if (!text.empty() && text[0] == '-') return false;
  }
  // Most click-log numbers are small integers: one conversion, as exact.
  if (!text.empty() && text.size() <= 9) {
    int32_t integer = 0;
    size_t i = text[0] == '-' ? 1 : 0;
    const bool negative = i == 1;
    for (; i < text.size() && text[i] >= '0' && text[i] <= '9'; ++i) {
      integer = integer * 10 + (text[i] - '0');
    }
    if (i == text.size() && text.size() > size_t{negative}) {
      *value = static_cast<float>(negative ? -integer : integer);
      return true;
    }
  }
  const char* end = text.data() + text.size();
  const absl::from_chars_result result = absl::from_chars(text.data(), end, *value);
  if (result.ptr != end || text.empty()) return false;
  if (result.ec == std::errc::result_out_of_range) {
    double wide = 0;
    const absl::from_chars_result again = absl::from_chars(text.data(), end, wide);
    if (again.ec != std::errc() || !(wide > -FLT_MIN && wide < FLT_MIN)) return false;
    *value = static_cast<float>(wide);
    return true;
  }
  return result.ec == std::errc() && std::isfinite(*value);
}

// Each byte's hex value, 255 for a byte that is no hex digit.
constexpr std::array<uint8_t, 256> kHexDigits = [] {
  std::array<uint8_t, 256> digits{};
  for (int c = 0; c < 256; ++c) {
    digits[c] = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                                       : 255;
  }
  return digits;
}();

bool ParseHex(absl::string_view text, uint64_t* id) {
  if (text.empty() || text.size() > 16) return false;
  uint64_t value = 0;
  for (const char c : text) {
    const uint8_t digit = kHexDigits[static_cast<uint8_t>(c)];
    if (digit > 15) return false;
    value = (value << 4) | digit;
  }
  *id = value;
  return true;
}

absl::Status FieldError(const CsvColumn& column, absl::string_view value, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(
      "column ", column.name, " (", ColumnTypeName(column.type), "): ", Quoted(value), " ", what));
}

// Types the fields of a record: slot_[i] is column i's index in the vector of its type.
class RowTyper {
 public:
  void SetColumns(const std::vector<CsvColumn>& resolved) {
    columns_ = resolved;
    slot_.clear();
    numeric_ = categorical_ = text_ = 0;
    for (const CsvColumn& column : columns_) {
      switch (column.type) {
        case ColumnType::kNumeric:
          slot_.push_back(numeric_++);
          break;
        case ColumnType::kCategorical:
        case ColumnType::kCategoricalHex:
          slot_.push_back(categorical_++);
          break;
        case ColumnType::kText:
          slot_.push_back(text_++);
          break;
        default:
          slot_.push_back(0);
      }
    }
  }

  absl::Status Convert(absl::Span<const absl::string_view> fields, CsvRow* row) const;

 private:
  std::vector<CsvColumn> columns_;
  std::vector<size_t> slot_;
  size_t numeric_ = 0, categorical_ = 0, text_ = 0;
};

absl::Status RowTyper::Convert(absl::Span<const absl::string_view> fields, CsvRow* row) const {
  row->numeric.resize(numeric_);
  row->numeric_missing.resize(numeric_);
  row->categorical.resize(categorical_);
  row->text.resize(text_);
  for (size_t i = 0; i < fields.size(); ++i) {
    const absl::string_view field = fields[i];
    const CsvColumn& column = columns_[i];
    switch (column.type) {
      case ColumnType::kLabel:
        if (!ParseLabel(field, &row->label)) {
          return FieldError(column, field, "is not a non-negative integer");
        }
        break;
      case ColumnType::kNumeric: {
        const absl::string_view number = Trim(field);
        row->numeric_missing[slot_[i]] = number.empty();
        row->numeric[slot_[i]] = 0;
        if (!number.empty() && !ParseFloat(number, &row->numeric[slot_[i]])) {
          return FieldError(column, field, "is not a finite float");
        }
        break;
      }
      case ColumnType::kCategorical:
        row->categorical[slot_[i]] = field.empty() ? kMissingId : HashId(field);
        break;
      case ColumnType::kCategoricalHex: {
        const absl::string_view hex = Trim(field);
        row->categorical[slot_[i]] = kMissingId;
        if (!hex.empty() && !ParseHex(hex, &row->categorical[slot_[i]])) {
          return FieldError(column, field, "is not an id of 1 to 16 hex digits");
        }
        break;
      }
      case ColumnType::kText:
        row->text[slot_[i]].assign(field.data(), field.size());
        break;
      case ColumnType::kIgnore:
        break;
    }
  }
  return absl::OkStatus();
}

}  // namespace

struct CsvReader::Parse {
  RowTyper typer;
  Scan scan;
};

absl::string_view ColumnTypeName(ColumnType type) {
  switch (type) {
    case ColumnType::kLabel:
      return "label";
    case ColumnType::kNumeric:
      return "numeric";
    case ColumnType::kCategorical:
      return "categorical";
    case ColumnType::kCategoricalHex:
      return "hex";
    case ColumnType::kText:
      return "text";
    case ColumnType::kIgnore:
      return "ignore";
  }
  return "?";
}

absl::StatusOr<std::vector<CsvColumn>> ParseColumns(absl::string_view spec) {
  std::vector<CsvColumn> columns;
  for (absl::string_view entry : absl::StrSplit(spec, ',')) {
    entry = absl::StripAsciiWhitespace(entry);
    if (entry.empty()) return absl::InvalidArgumentError("column spec: an empty entry");
    CsvColumn column;
    const size_t colon = entry.rfind(':');
    column.name = std::string(absl::StripAsciiWhitespace(entry.substr(0, colon)));
    if (colon != absl::string_view::npos) {
      const absl::string_view name = absl::StripAsciiWhitespace(entry.substr(colon + 1));
      const ColumnType* found = nullptr;
      for (const ColumnType& type : kAllTypes) {
        if (ColumnTypeName(type) == name) found = &type;
      }
      if (found == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("column spec: unknown type \"", name, "\" for column ", column.name,
                         " (types: label, numeric, categorical, hex, text, ignore)"));
      }
      column.type = *found;
    }
    columns.push_back(std::move(column));
  }
  PSFLOW_RETURN_IF_ERROR(ValidateColumns(columns, /*allow_wildcard=*/true));
  return columns;
}

CsvFormat CriteoFormat() {
  CsvFormat format;
  format.delimiter = '\t';
  format.header = false;
  format.columns.push_back({"label", ColumnType::kLabel});
  for (int i = 1; i <= 13; ++i) {
    format.columns.push_back({absl::StrCat("I", i), ColumnType::kNumeric});
  }
  for (int i = 1; i <= 26; ++i) {
    format.columns.push_back({absl::StrCat("C", i), ColumnType::kCategoricalHex});
  }
  return format;
}

absl::StatusOr<CsvFormat> ResolveHeader(CsvFormat format, const std::vector<std::string>& header) {
  PSFLOW_RETURN_IF_ERROR(ValidateColumns(format.columns, /*allow_wildcard=*/true));
  absl::flat_hash_map<absl::string_view, const CsvColumn*> listed;
  const CsvColumn* rest = nullptr;
  for (const CsvColumn& column : format.columns) {
    if (column.name == kWildcard) {
      rest = &column;
    } else {
      listed[column.name] = &column;
    }
  }
  std::vector<CsvColumn> resolved;
  std::vector<std::string> unlisted, twice;
  absl::flat_hash_set<absl::string_view> seen;
  for (const std::string& name : header) {
    auto it = listed.find(name);
    if (it != listed.end()) {
      if (!seen.insert(name).second) twice.push_back(name);
      resolved.push_back({name, it->second->type});
    } else if (rest != nullptr) {
      resolved.push_back({name, rest->type});
    } else {
      unlisted.push_back(name);
    }
  }
  std::vector<std::string> lacking;
  for (const CsvColumn& column : format.columns) {
    if (column.name != kWildcard && !seen.contains(column.name)) lacking.push_back(column.name);
  }
  if (!lacking.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the header lacks the spec's columns ", NameList(lacking)));
  }
  if (!twice.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the header names the spec's columns ", NameList(twice), " twice"));
  }
  if (!unlisted.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("the header's columns ", NameList(unlisted),
                     " are not in the column spec (list them, or add *:ignore to skip them)"));
  }
  format.columns = std::move(resolved);
  return format;
}

absl::Status ParseRow(absl::string_view record, const CsvFormat& format, CsvRow* row) {
  PSFLOW_RETURN_IF_ERROR(ValidateColumns(format.columns, /*allow_wildcard=*/false));
  std::string copy(record);  // "" is undone in place
  Scan scan;
  const ScanResult result = ScanRecord(copy.data(), copy.size(), true, format.delimiter, &scan);
  if (result == ScanResult::kError) return absl::InvalidArgumentError(scan.error);
  if (scan.consumed != copy.size()) {
    return absl::InvalidArgumentError("more than one record (a line break outside quotes)");
  }
  if (scan.fields.size() != format.columns.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat(scan.fields.size(), " fields, the columns say ", format.columns.size()));
  }
  std::vector<absl::string_view> fields;
  MakeViews(copy.data(), scan, &fields);
  RowTyper typer;
  typer.SetColumns(format.columns);
  return typer.Convert(fields, row);
}

CsvReader::CsvReader(std::string path, CsvFormat format, int fd)
    : path_(std::move(path)),
      format_(std::move(format)),
      parse_(std::make_unique<Parse>()),
      fd_(fd),
      buffer_(kReadBytes) {}

CsvReader::~CsvReader() { ::close(fd_); }

absl::StatusOr<std::unique_ptr<CsvReader>> CsvReader::Open(const std::string& path,
                                                           CsvFormat format) {
  const char d = format.delimiter;
  if (d == '"' || d == '\n' || d == '\r') {
    return absl::InvalidArgumentError(
        absl::StrCat("the delimiter cannot be ", absl::CHexEscape(std::string(1, d))));
  }
  if (!format.columns.empty()) {
    PSFLOW_RETURN_IF_ERROR(ValidateColumns(format.columns, format.header));
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::Status(absl::ErrnoToStatusCode(errno),
                        absl::StrCat("cannot open ", path, ": ", std::strerror(errno)));
  }
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  std::unique_ptr<CsvReader> reader(new CsvReader(path, std::move(format), fd));
  while (reader->end_ < 3 && !reader->eof_) PSFLOW_RETURN_IF_ERROR(reader->Fill());
  if (reader->end_ >= 3 && std::memcmp(reader->buffer_.data(), "\xEF\xBB\xBF", 3) == 0) {
    reader->begin_ = 3;  // a UTF-8 byte order mark, as spreadsheets write
  }
  if (reader->format_.header) PSFLOW_RETURN_IF_ERROR(reader->ReadHeader());
  reader->parse_->typer.SetColumns(reader->format_.columns);
  return reader;
}

absl::Status CsvReader::ReadHeader() {
  PSFLOW_ASSIGN_OR_RETURN(const bool found, ReadRecord());
  if (!found) {
    return absl::InvalidArgumentError(absl::StrCat(path_, ": empty, but the format has a header"));
  }
  for (const absl::string_view name : fields_) header_.emplace_back(name);
  if (format_.columns.empty()) return absl::OkStatus();
  absl::StatusOr<CsvFormat> resolved = ResolveHeader(format_, header_);
  if (!resolved.ok()) return Error(record_line_, resolved.status().message());
  format_ = *std::move(resolved);
  return absl::OkStatus();
}

absl::Status CsvReader::Fill() {
  const size_t kept = end_ - begin_;
  if (begin_ > 0) {
    std::memmove(buffer_.data(), buffer_.data() + begin_, kept);
    begin_ = 0;
    end_ = kept;
  }
  if (buffer_.size() - end_ < kReadBytes)
    buffer_.resize(std::max(2 * buffer_.size(), end_ + kReadBytes));
  ssize_t n;
  do {
    n = ::read(fd_, buffer_.data() + end_, buffer_.size() - end_);
  } while (n < 0 && errno == EINTR);
  if (n < 0) {
    return absl::Status(
        absl::ErrnoToStatusCode(errno),
        absl::StrCat(path_, ":", next_line_, ": read failed: ", std::strerror(errno)));
  }
  if (n == 0) eof_ = true;
  end_ += n;
  return absl::OkStatus();
}

absl::StatusOr<bool> CsvReader::ReadRecord() {
  Scan& scan = parse_->scan;
  while (true) {
    if (begin_ == end_) {
      if (eof_) return false;
      PSFLOW_RETURN_IF_ERROR(Fill());
      continue;
    }
    char* data = buffer_.data() + begin_;
    const size_t size = end_ - begin_;
    const ScanResult result = ScanRecord(data, size, eof_, format_.delimiter, &scan);
    if (result == ScanResult::kNeedMore) {
      if (size >= kMaxCsvRecordBytes) {
        return Error(next_line_, "a record of more than 64 MiB (an unterminated quote?)");
      }
      PSFLOW_RETURN_IF_ERROR(Fill());
      continue;
    }
    if (result == ScanResult::kError) return Error(next_line_ + scan.line_breaks, scan.error);
    record_line_ = next_line_;
    next_line_ += scan.line_breaks;
    begin_ += scan.consumed;
    if (IsBlank(data, scan)) continue;
    MakeViews(data, scan, &fields_);
    return true;
  }
}

absl::Status CsvReader::CheckFieldCount() const {
  const size_t want = format_.columns.size();
  if (want == 0 || fields_.size() == want) return absl::OkStatus();
  return Error(record_line_, absl::StrCat(fields_.size(), " fields, the columns say ", want));
}

absl::Status CsvReader::Error(int64_t line, absl::string_view message) const {
  return absl::InvalidArgumentError(absl::StrCat(path_, ":", line, ": ", message));
}

absl::StatusOr<bool> CsvReader::NextRow(std::vector<std::string>* fields) {
  PSFLOW_ASSIGN_OR_RETURN(const bool found, ReadRecord());
  if (!found) return false;
  PSFLOW_RETURN_IF_ERROR(CheckFieldCount());
  fields->resize(fields_.size());
  for (size_t i = 0; i < fields_.size(); ++i)
    (*fields)[i].assign(fields_[i].data(), fields_[i].size());
  return true;
}

absl::StatusOr<bool> CsvReader::Next(CsvRow* row) {
  if (format_.columns.empty()) {
    return absl::FailedPreconditionError(
        absl::StrCat(path_, ": no columns to type the fields by (NextRow reads them untyped)"));
  }
  PSFLOW_ASSIGN_OR_RETURN(const bool found, ReadRecord());
  if (!found) return false;
  PSFLOW_RETURN_IF_ERROR(CheckFieldCount());
  const absl::Status converted = parse_->typer.Convert(fields_, row);
  if (!converted.ok()) return Error(record_line_, converted.message());
  return true;
}

absl::StatusOr<int64_t> CountRows(const std::string& path, const CsvFormat& format) {
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<CsvReader> reader, CsvReader::Open(path, format));
  int64_t rows = 0;
  while (true) {
    PSFLOW_ASSIGN_OR_RETURN(const bool found, reader->ReadRecord());
    if (!found) return rows;
    PSFLOW_RETURN_IF_ERROR(reader->CheckFieldCount());
    ++rows;
  }
}

absl::StatusOr<CsvFormat> CsvFormatFromFlags(const std::string& preset, const std::string& columns,
                                             const std::string& delimiter, bool header) {
  if (preset == "criteo") return CriteoFormat();
  if (!preset.empty()) {
    return absl::InvalidArgumentError(absl::StrCat("--csv_preset '", preset, "' is not criteo"));
  }
  if (columns.empty()) {
    return absl::InvalidArgumentError(
        "--csv_columns must say which column is the label (e.g. 'label:label,*:numeric'), or "
        "give --csv_preset");
  }
  CsvFormat format;
  PSFLOW_ASSIGN_OR_RETURN(format.columns, ParseColumns(columns));
  format.header = header;
  if (delimiter == "tab" || delimiter == "\\t") {
    format.delimiter = '\t';
  } else if (delimiter.size() == 1) {
    format.delimiter = delimiter[0];
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("--csv_delimiter '", delimiter, "' is not one character (or tab)"));
  }
  return format;
}

}  // namespace psflow::data
