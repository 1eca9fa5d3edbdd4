// Writing MNIST-format IDX files for tests: the bytes of a file, and writing
// them plain or gzipped (failures are gtest assertion failures).
#ifndef PSFLOW_TESTS_DATA_IDX_FILES_H_
#define PSFLOW_TESTS_DATA_IDX_FILES_H_

#include <cstdint>
#include <string>
#include <vector>

namespace psflow::data::idx_testing {

// Big-endian magic and dimensions, then `data`.
std::vector<uint8_t> IdxBytes(uint32_t magic, const std::vector<uint32_t>& dims,
                              const std::vector<uint8_t>& data);
void WritePlain(const std::string& path, const std::vector<uint8_t>& bytes);
void WriteGzip(const std::string& path, const std::vector<uint8_t>& bytes);

}  // namespace psflow::data::idx_testing

#endif  // PSFLOW_TESTS_DATA_IDX_FILES_H_
