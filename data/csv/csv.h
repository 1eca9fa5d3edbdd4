// Reading CSV and TSV training data: RFC 4180 records turned into typed rows
// (a label, numeric features, hashed categorical ids, raw text).
//
// A column spec names each column's type; CriteoFormat() is the Criteo click
// log's. CsvReader reads a file with large buffered reads (it is meant for
// click logs of many GB) and reports every malformed input as an
// InvalidArgument status of one line naming file:line. The free functions are
// thread-safe; a CsvReader is used by one thread at a time.
#ifndef PSFLOW_DATA_CSV_CSV_H_
#define PSFLOW_DATA_CSV_CSV_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace psflow::data {

// Spaces around a label, numeric or hex field are dropped; categorical and
// text fields are taken byte for byte.
enum class ColumnType {
  kLabel,           // the class: a non-negative integer (int64), never empty
  kNumeric,         // a decimal float (7, -2.5, 3e-4) in float's range, nan and inf
                    // refused; empty is missing: 0 and a missing flag of 1
  kCategorical,     // any string, hashed by HashId; empty is kMissingId
  kCategoricalHex,  // an id already hashed, as 1 to 16 hex digits; empty is kMissingId
  kText,            // kept as written
  kIgnore,          // read (and counted) but not kept
};

// The spec's name of a type: label, numeric, categorical, hex, text, ignore.
absl::string_view ColumnTypeName(ColumnType type);

struct CsvColumn {
  std::string name;
  ColumnType type = ColumnType::kNumeric;
  bool operator==(const CsvColumn&) const = default;
};

struct CsvFormat {
  char delimiter = ',';
  // The first record names the columns (see ResolveHeader).
  bool header = true;
  // Without a header, one entry per field in file order. With a header, the
  // spec ParseColumns gives: any subset of the header's names, in any order,
  // plus at most one "*" entry giving the type of the columns it does not list.
  std::vector<CsvColumn> columns;
};

// Parses a column spec, "label:label,price:numeric,city:categorical,c1:hex,
// title:text,url:ignore": comma-separated name:type entries (types as
// ColumnTypeName writes them; a bare name is numeric; spaces around entries are
// dropped). "*:type" (not label) stands for every header column not listed.
// Errors: an empty entry or name, an unknown type, a name given twice, other
// than exactly one label column.
absl::StatusOr<std::vector<CsvColumn>> ParseColumns(absl::string_view spec);

// Criteo's click logs (Display Advertising Challenge, 1 TB logs): tab-separated,
// no header, 40 columns: "label" (0 or 1), "I1".."I13" numeric and
// "C1".."C26" hex (8 hex digits, hashed by Criteo), any of I and C may be empty.
CsvFormat CriteoFormat();

// The layout the CSV flags give (--csv_preset, --csv_columns,
// --csv_delimiter: one character, "tab" or "\\t", --csv_header): the named
// preset ("criteo"), or the column spec with the delimiter and header.
// INVALID_ARGUMENT naming the flag: an unknown preset, no columns, a
// delimiter of another length, and ParseColumns' errors.
absl::StatusOr<CsvFormat> CsvFormatFromFlags(const std::string& preset, const std::string& columns,
                                             const std::string& delimiter, bool header);

// Gives format.columns in the header's order, each typed by the spec entry of
// its name or else by the "*" entry. A header column the spec neither lists
// nor covers by "*" is an error (new columns in the data are not dropped
// unnoticed; "*:ignore" drops them on purpose), as are spec names the header
// lacks and a listed name the header has twice. CsvReader::Open calls it.
absl::StatusOr<CsvFormat> ResolveHeader(CsvFormat format, const std::vector<std::string>& header);

// The id of a categorical value: 64-bit FNV-1a of its bytes (UTF-8 as written,
// no normalization): h = 0xcbf29ce484222325; for each byte b:
// h = (h ^ b) * 0x100000001b3 mod 2^64. HashId("") is the offset basis, but an
// empty field is kMissingId, not HashId("").
constexpr uint64_t kFnv64OffsetBasis = 0xcbf29ce484222325ULL;
constexpr uint64_t kFnv64Prime = 0x100000001b3ULL;
inline uint64_t HashId(absl::string_view value) {
  uint64_t h = kFnv64OffsetBasis;
  for (const char c : value) h = (h ^ static_cast<uint8_t>(c)) * kFnv64Prime;
  return h;
}
// The id of an empty categorical or hex field. A value that hashes to 0 (or
// hex "0") shares it; with 64-bit ids that is left to chance.
constexpr uint64_t kMissingId = 0;

// One record, typed: each vector holds its type's columns in column order
// (numeric[i] and numeric_missing[i] are the i-th numeric column).
struct CsvRow {
  int64_t label = 0;
  std::vector<float> numeric;
  std::vector<uint8_t> numeric_missing;  // 1 where the field was empty (numeric is then 0)
  std::vector<uint64_t> categorical;     // categorical and hex columns, in column order
  std::vector<std::string> text;
};

// Types one record held in memory (one line, a final line break optional;
// quoted fields may hold line breaks) by format.columns, which must be
// resolved (no "*"). Errors as CsvReader's, without file:line.
absl::Status ParseRow(absl::string_view record, const CsvFormat& format, CsvRow* row);

// The longest record a reader takes; past it an unterminated quote is the likely
// cause, and the reader stops instead of holding the rest of the file.
constexpr size_t kMaxCsvRecordBytes = size_t{64} << 20;

// Reads one file record by record. RFC 4180: fields quoted by '"' may hold the
// delimiter, line breaks and '"' written twice; lines end in LF or CRLF, the
// last one with or without; a UTF-8 byte order mark at the start is skipped;
// blank lines are skipped (no format here has one column that may be empty).
// Not thread-safe; it owns its file descriptor.
class CsvReader {
 public:
  // Opens path and, when format.header, reads the header and resolves
  // format.columns by it. With no columns at all, fields are returned unchecked
  // by NextRow (and Next refuses).
  static absl::StatusOr<std::unique_ptr<CsvReader>> Open(const std::string& path, CsvFormat format);
  ~CsvReader();
  CsvReader(const CsvReader&) = delete;
  CsvReader& operator=(const CsvReader&) = delete;

  // The next record's fields as written (quotes removed, doubled quotes
  // undone), ignored columns included. False at the end of the file.
  absl::StatusOr<bool> NextRow(std::vector<std::string>* fields);
  // The next record, typed by the columns. False at the end of the file.
  absl::StatusOr<bool> Next(CsvRow* row);

  // The 1-based line the last record read began on (a quoted line break makes
  // a record span lines); 0 before any.
  int64_t line() const { return record_line_; }
  // The resolved format (header order, no "*").
  const CsvFormat& format() const { return format_; }
  // The header's names as written; empty without a header.
  const std::vector<std::string>& header() const { return header_; }

 private:
  struct Parse;  // the typed layout and the record scanner's state
  CsvReader(std::string path, CsvFormat format, int fd);
  absl::Status Fill();
  absl::StatusOr<bool> ReadRecord();
  absl::Status CheckFieldCount() const;
  absl::Status ReadHeader();
  absl::Status Error(int64_t line, absl::string_view message) const;
  friend absl::StatusOr<int64_t> CountRows(const std::string& path, const CsvFormat& format);

  std::string path_;
  CsvFormat format_;
  std::unique_ptr<Parse> parse_;
  std::vector<std::string> header_;
  int fd_ = -1;
  bool eof_ = false;
  std::vector<char> buffer_;
  size_t begin_ = 0, end_ = 0;  // unread bytes: buffer_[begin_, end_)
  int64_t next_line_ = 1;       // the line the next record begins on
  int64_t record_line_ = 0;
  std::vector<absl::string_view> fields_;  // the last record's, into buffer_
};

// The data records of a file (the header and blank lines not counted), checked
// as NextRow checks them: quoted line breaks are inside a record, and a
// malformed record is the error it is to the reader.
absl::StatusOr<int64_t> CountRows(const std::string& path, const CsvFormat& format);

}  // namespace psflow::data

#endif  // PSFLOW_DATA_CSV_CSV_H_
