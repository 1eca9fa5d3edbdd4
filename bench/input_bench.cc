// psflow-bench-input: images/s of the streaming input pipeline
// (data/pipeline.h) over TFRecord shards of JPEG tf.Examples, as a worker's
// trainer reads them: model input 3x224x224, training order (shuffle buffer,
// per-epoch piece order), the decode pool of --threads. bench/input_pipeline.sh
// runs it beside the same recipe in tf.data.
//
// One line per run:
//   input mode=augment threads=2 batch=64 batches=40 images_per_s=912.4
//     cpu_ms_per_image=2.101 waited_s=2.8
// cpu_ms_per_image: the CPU time of all the process' threads over the timed
// batches, per image (the reader runs ahead, so within a few batches): a
// figure that holds when other work shares the cores.
// mode=augment: RandomResizedCrop and flip (DataConfig.augment); mode=center:
// the shorter side to --resize_shorter and the central 224x224. The first
// (warm-up) batch, which also fills the shuffle buffer, is not timed.
//
// --profile also times (thread CPU time) the stages of one image on one
// thread over the first --profile_images records (parse, crop-decode,
// resize), to say what bounds the pipeline.
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/status_macros.h"
#include "data/formats.h"
#include "data/image/image.h"
#include "data/image/transforms.h"
#include "data/pipeline.h"
#include "data/tfrecord/example.h"
#include "data/tfrecord/record_file.h"
#include "role/command_line.h"

ABSL_FLAG(std::string, files, "", "TFRecord shards: comma-separated paths or glob patterns.");
ABSL_FLAG(std::string, mode, "augment", "augment (random resized crop + flip) or center.");
ABSL_FLAG(int, resize_shorter, 256, "mode=center: the shorter side before the central crop.");
ABSL_FLAG(int, batch, 64, "Images per batch.");
ABSL_FLAG(int, batches, 40, "Timed batches, after one warm-up batch.");
ABSL_FLAG(int, threads, 2, "Decode threads of the pipeline.");
ABSL_FLAG(int, shuffle_buffer, 1000, "Records in the shuffle buffer.");
ABSL_FLAG(int, prefetch, 4, "Batches read ahead.");
ABSL_FLAG(int, num_classes, 1000, "Labels must lie in [0, num_classes).");
ABSL_FLAG(bool, profile, false, "Also time parse, decode and resize of one image on one thread.");
ABSL_FLAG(int, profile_images, 300, "--profile: the records timed.");

namespace {

using psflow::DataConfig;

// CPU seconds of this process (all its threads) so far.
double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec + (u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

// CPU time of the calling thread: stage times that hold when other work
// shares the cores.
absl::Duration ThreadCpu() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return absl::DurationFromTimespec(t);
}

constexpr int kSide = 224;

// The stages of the augment decode of data/formats.cc's ImageDecoder, timed
// one by one on this thread: parse the Example, choose the window, decode it,
// resample it to 224x224 floats.
absl::Status Profile(const std::string& path, int images, bool augment, int resize_shorter) {
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<psflow::data::RecordReader> reader,
                          psflow::data::RecordReader::Open(path));
  std::vector<std::string> records;
  std::string record;
  while (static_cast<int>(records.size()) < images) {
    PSFLOW_ASSIGN_OR_RETURN(const bool got, reader->Next(&record));
    if (!got) break;
    records.push_back(record);
  }
  std::vector<float> out(3 * kSide * kSide);
  psflow::data::Image image;  // reused, as the pipeline's decoders do
  absl::Duration parse, decode, resize;
  int64_t decoded_pixels = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const absl::Duration t = ThreadCpu();
    PSFLOW_ASSIGN_OR_RETURN(const psflow::data::Example ex, psflow::data::ParseExample(records[i]));
    PSFLOW_ASSIGN_OR_RETURN(const absl::string_view bytes,
                            psflow::data::OneBytes(ex, "image/encoded"));
    PSFLOW_ASSIGN_OR_RETURN(const psflow::data::ImageSize size, psflow::data::PeekImageSize(bytes));
    const psflow::data::CropWindow window =
        augment ? psflow::data::RandomResizedCrop(size, i)
                : psflow::data::CenterCrop(size, resize_shorter, kSide, kSide);
    const absl::Duration t1 = ThreadCpu();
    psflow::data::CropWindow placed;
    PSFLOW_RETURN_IF_ERROR(psflow::data::DecodeImageInto(bytes, 3, &window, &image, &placed));
    const absl::Duration t2 = ThreadCpu();
    PSFLOW_RETURN_IF_ERROR(
        psflow::data::ResizeInto(image, placed, kSide, kSide, (i & 1) != 0, out.data()));
    resize += ThreadCpu() - t2;
    decode += t2 - t1;
    parse += t1 - t;
    decoded_pixels += int64_t{window.height} * window.width;
  }
  const double n = static_cast<double>(std::max<size_t>(records.size(), 1));
  const double total = absl::ToDoubleMilliseconds(parse + decode + resize) / n;
  std::printf(
      "profile mode=%s images=%zu cpu_ms_per_image: parse=%.3f decode=%.3f resize=%.3f total=%.3f "
      "(one thread: %.1f images/s; decoded window %.0f pixels on average)\n",
      augment ? "augment" : "center", records.size(), absl::ToDoubleMilliseconds(parse) / n,
      absl::ToDoubleMilliseconds(decode) / n, absl::ToDoubleMilliseconds(resize) / n, total,
      1000.0 / total, static_cast<double>(decoded_pixels) / n);
  return absl::OkStatus();
}

absl::Status Run() {
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode != "augment" && mode != "center") {
    return absl::InvalidArgumentError("--mode must be augment or center");
  }
  DataConfig config = psflow::data::DefaultDataConfig();
  config.set_format("tfrecord");
  config.set_augment(mode == "augment");
  config.set_resize_shorter(absl::GetFlag(FLAGS_resize_shorter));
  PSFLOW_RETURN_IF_ERROR(psflow::data::ResolveDataFiles({absl::GetFlag(FLAGS_files), ""}, &config));
  const psflow::data::ExampleShape shape{3, kSide, kSide, absl::GetFlag(FLAGS_num_classes)};
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<psflow::data::DataFormat> format,
                          psflow::data::OpenDataFormat(config, shape, psflow::data::Split::kTrain));
  psflow::data::PipelineOptions o;
  o.batch = absl::GetFlag(FLAGS_batch);
  o.train = true;
  o.shuffle_buffer = absl::GetFlag(FLAGS_shuffle_buffer);
  o.prefetch_batches = absl::GetFlag(FLAGS_prefetch);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.seed = 1;
  PSFLOW_ASSIGN_OR_RETURN(std::unique_ptr<psflow::data::Pipeline> pipeline,
                          psflow::data::Pipeline::Create(format.get(), o));
  const int64_t per_epoch = pipeline->batches_per_epoch();
  const int batches = absl::GetFlag(FLAGS_batches);
  absl::Time start;
  absl::Duration waited_before;
  double cpu_before = 0;
  for (int64_t b = 0; b <= batches; ++b) {
    if (b == 1) {
      start = absl::Now();
      waited_before = pipeline->waited();
      cpu_before = CpuSeconds();
    }
    PSFLOW_ASSIGN_OR_RETURN(const psflow::data::Batch* batch,
                            pipeline->Get(b / per_epoch, b % per_epoch));
    (void)batch;
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - start);
  const double cpu = CpuSeconds() - cpu_before;
  std::printf(
      "input mode=%s threads=%d batch=%d batches=%d images_per_s=%.1f cpu_ms_per_image=%.3f "
      "waited_s=%.2f\n",
      mode.c_str(), o.threads, static_cast<int>(o.batch), batches, batches * o.batch / seconds,
      cpu * 1e3 / (batches * o.batch), absl::ToDoubleSeconds(pipeline->waited() - waited_before));
  if (absl::GetFlag(FLAGS_profile)) {
    PSFLOW_RETURN_IF_ERROR(Profile(config.train(0).path(), absl::GetFlag(FLAGS_profile_images),
                                   mode == "augment", config.resize_shorter()));
  }
  return absl::OkStatus();
}

}  // namespace

int main(int argc, char** argv) {
  psflow::ParseCommandLine(argc, argv,
                           "images/s of the input pipeline over TFRecord shards of JPEGs.\n"
                           "  psflow-bench-input --files=DIR/train-* [--mode=augment|center]",
                           {"input_bench.cc"});
  absl::Status s = Run();
  std::fflush(stdout);
  return s.ok() ? 0 : psflow::FailWith(s);
}
