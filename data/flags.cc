#include "data/flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, data_format, "",
          "The format of the data: idx (MNIST-format files in --data_dir), synthetic (made in "
          "memory), tfrecord (TFRecord files of tf.Example, plain or GZIP), image_folder "
          "(<root>/<class>/<image>.jpg|png) or csv (CSV/TSV files). Empty: recognized from "
          "--train_files or from what --data_dir holds. See docs/data.md.");
ABSL_FLAG(std::string, eval_files, "",
          "The evaluation data: comma-separated paths or glob patterns of TFRecord or CSV files, "
          "or an image folder. Empty: validation-*/test-* (tfrecord), val/validation/test "
          "(image_folder) or test.csv/test.tsv (csv) in --data_dir.");
ABSL_FLAG(std::string, image_key, "image/encoded",
          "tfrecord: the tf.Example bytes feature holding the encoded JPEG or PNG image.");
ABSL_FLAG(std::string, label_key, "image/class/label",
          "tfrecord: the tf.Example int64 feature holding the class.");
ABSL_FLAG(int64_t, label_offset, 0,
          "tfrecord: subtracted from every label, so that the classes start at 0 (1 for sets "
          "whose label 0 is 'background', as TensorFlow's ImageNet recipe writes them).");
ABSL_FLAG(int, resize_shorter, 0,
          "Images: evaluation (and training without --augment) resizes the shorter side to this "
          "and cuts out the center at the model's input size. 0: the model's shorter input side "
          "(images of the model's size pass unchanged); 256 is the usual recipe for 224x224.");
ABSL_FLAG(std::string, csv_columns, "",
          "csv: the columns, 'name:type,...' with types label, numeric, categorical, hex, text, "
          "ignore ('*:type' for every header column not listed). Exactly one label column; the "
          "numeric columns, in file order, are the model's input.");
ABSL_FLAG(std::string, csv_delimiter, ",", "csv: the field delimiter, one character or 'tab'.");
ABSL_FLAG(bool, csv_header, true,
          "csv: the files start with a header naming the columns (--csv_columns then types them "
          "by name); without one, --csv_columns lists every column in order.");
ABSL_FLAG(std::string, csv_preset, "",
          "csv: a named layout instead of --csv_columns: criteo (tab-separated, no header, "
          "label, I1-I13 numeric, C1-C26 hex).");
ABSL_FLAG(bool, skip_bad_records, false,
          "TFRecord records whose checksum fails are skipped and counted instead of failing the "
          "job (a broken length ends its file: the rest cannot be framed).");

namespace psflow::data {

DataConfig DataConfigFromFlags() {
  DataConfig c = DefaultDataConfig();
  c.set_format(absl::GetFlag(FLAGS_data_format));
  c.set_image_key(absl::GetFlag(FLAGS_image_key));
  c.set_label_key(absl::GetFlag(FLAGS_label_key));
  c.set_label_offset(absl::GetFlag(FLAGS_label_offset));
  c.set_resize_shorter(absl::GetFlag(FLAGS_resize_shorter));
  c.set_csv_columns(absl::GetFlag(FLAGS_csv_columns));
  c.set_csv_delimiter(absl::GetFlag(FLAGS_csv_delimiter));
  c.set_csv_header(absl::GetFlag(FLAGS_csv_header));
  c.set_csv_preset(absl::GetFlag(FLAGS_csv_preset));
  c.set_skip_bad_records(absl::GetFlag(FLAGS_skip_bad_records));
  return c;
}

std::string EvalFilesFromFlags() { return absl::GetFlag(FLAGS_eval_files); }

}  // namespace psflow::data
