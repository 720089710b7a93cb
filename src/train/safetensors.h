// safetensors files: an 8-byte little-endian header length, a JSON header (each tensor's name ->
// dtype, shape, data_offsets; an optional __metadata__ object of strings), then the data.
// Checkpoints, Hugging Face imports and exports all go through here.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "core/mapped_file.h"
#include "core/tensor.h"

namespace mt {

struct SafetensorsFile {
  std::map<std::string, Tensor> tensors;
  std::map<std::string, std::string> metadata;
};
// Written atomically (core/atomic_file.h).
void write_safetensors(const std::string& path, const SafetensorsFile& f);
// Every tensor copied into host memory. Errors are CheckpointErrors naming the file and tensor.
SafetensorsFile read_safetensors(const std::string& path);
// The __metadata__ of a file, reading its header only.
std::map<std::string, std::string> read_safetensors_metadata(const std::string& path);

// A tensor where it lies in a mapped file.
struct SafetensorsEntry {
  DType dtype;
  Shape shape;
  const uint8_t* data;
};

// A file mapped read-only: the header is parsed and checked (every tensor's bytes lie inside the
// file, none overlaps the header), and the data is read from disk only where it is touched, so a
// rank that needs a slice of a tensor never holds the rest.
class MappedSafetensors {
 public:
  explicit MappedSafetensors(const std::string& path);
  ~MappedSafetensors();
  MappedSafetensors(const MappedSafetensors&) = delete;
  MappedSafetensors& operator=(const MappedSafetensors&) = delete;
  const std::map<std::string, SafetensorsEntry>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const std::string& path() const { return path_; }
  // Drops the pages read so far from this process: a reader going through a large file a part
  // at a time holds one part.
  void release_pages() const { file_.release_pages(); }

 private:
  std::string path_;
  MappedFile file_;
  std::map<std::string, SafetensorsEntry> tensors_;
  std::map<std::string, std::string> metadata_;
};

// A file written one tensor at a time (an export holds one unit's tensors at once): the header is
// fixed at construction from every tensor's name, dtype and shape, in the given order; write()
// puts a tensor's bytes at its place; commit() requires that every tensor was written.
class SafetensorsWriter {
 public:
  struct Planned {
    std::string name;
    DType dtype;
    Shape shape;
  };
  SafetensorsWriter(const std::string& path, const std::vector<Planned>& tensors,
                    const std::map<std::string, std::string>& metadata);
  ~SafetensorsWriter();
  void write(const std::string& name, const void* bytes, size_t nbytes);
  void commit();

 private:
  struct Place {
    uint64_t offset, nbytes;
    bool written;
  };
  std::unique_ptr<class AtomicFile> file_;
  std::map<std::string, Place> places_;
};

}  // namespace mt
