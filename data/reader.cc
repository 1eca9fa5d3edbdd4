#include "data/reader.h"

namespace psflow::data {

int64_t IdsPerExample(const std::vector<IdFeature>& features) {
  int64_t n = 0;
  for (const IdFeature& f : features) n += f.width;
  return n;
}

const std::vector<IdFeature>& DataFormat::id_features() const {
  static const std::vector<IdFeature>* const kNone = new std::vector<IdFeature>();
  return *kNone;
}

}  // namespace psflow::data
