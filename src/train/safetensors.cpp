#include "train/safetensors.h"

#include <cstring>
#include <nlohmann/json.hpp>

#include "core/atomic_file.h"
#include "core/error.h"

namespace mt {

namespace {

// The header JSON, every length in bytes.
std::string header_json(const nlohmann::ordered_json& header) {
  std::string h = header.dump();
  h.append((8 - h.size() % 8) % 8, ' ');  // keep the data 8-byte aligned
  return h;
}

}  // namespace

void write_safetensors(const std::string& path, const SafetensorsFile& f) {
  nlohmann::ordered_json header;
  if (!f.metadata.empty()) header["__metadata__"] = f.metadata;
  uint64_t offset = 0;
  for (const auto& [name, t] : f.tensors) {
    header[name] = {{"dtype", dtype_info(t.dtype()).safetensors},
                    {"shape", t.shape()},
                    {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  const std::string h = header_json(header);
  std::string head(8, '\0');
  const uint64_t hlen = h.size();
  std::memcpy(head.data(), &hlen, 8);
  head += h;
  // Each tensor straight from its memory into the file: no second copy of the whole state.
  AtomicFile file(path);
  file.append(head.data(), head.size());
  for (const auto& [_, t] : f.tensors) file.append(t.raw(), t.nbytes());
  file.commit();
}

MappedSafetensors::MappedSafetensors(const std::string& path) : path_(path) {
  std::string why;
  if (!file_.open(path, &why))
    throw CheckpointError(fmt::format("checkpoint: cannot open '{}': {}", path, why));
  const uint8_t* bytes = file_.data();
  const size_t size = file_.size();
  uint64_t hlen = 0;
  if (size >= 8) std::memcpy(&hlen, bytes, 8);
  if (size < 8 || hlen > size - 8)
    throw CheckpointError(fmt::format("checkpoint: '{}' is truncated or not safetensors", path));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + hlen);
  } catch (const std::exception& e) {
    throw CheckpointError(fmt::format("checkpoint: '{}' has a corrupt header: {}", path, e.what()));
  }
  const auto bad = [&](const std::string& what) {
    return CheckpointError(fmt::format("checkpoint: '{}' is corrupt: {}", path, what));
  };
  if (!header.is_object()) throw bad("its header is not a JSON object");
  const uint64_t data_size = size - 8 - hlen;
  const uint8_t* data = bytes + 8 + hlen;
  for (const auto& [name, info] : header.items()) {
    if (name == "__metadata__") {
      if (!info.is_object()) throw bad("__metadata__ is not an object");
      for (const auto& [k, v] : info.items()) {
        if (!v.is_string()) throw bad(fmt::format("metadata {} is not a string", k));
        metadata_[k] = v.get<std::string>();
      }
      continue;
    }
    if (!info.is_object() || !info.contains("dtype") || !info.contains("shape") ||
        !info.contains("data_offsets"))
      throw bad(fmt::format("tensor {} needs an object with dtype, shape and data_offsets", name));
    const auto& jd = info.at("dtype");
    DType dt;
    if (!jd.is_string() || !parse_safetensors_dtype(jd.get<std::string>(), &dt))
      throw CheckpointError(fmt::format("checkpoint: '{}': tensor {} has unsupported dtype {}",
                                        path, name, jd.dump()));
    const auto& js = info.at("shape");
    if (!js.is_array())
      throw bad(fmt::format("tensor {} has shape {}, not a list", name, js.dump()));
    Shape shape;
    uint64_t numel = 1;
    for (const auto& d : js) {
      if (!d.is_number_unsigned())
        throw bad(
            fmt::format("tensor {} has shape {}: sizes must be integers >= 0", name, js.dump()));
      const uint64_t v = d.get<uint64_t>();
      if (v != 0 && numel > data_size / v)  // more elements than the file has bytes
        throw bad(fmt::format("tensor {} has shape {}, larger than the file", name, js.dump()));
      numel *= v;
      shape.push_back(static_cast<int64_t>(v));
    }
    const auto& jo = info.at("data_offsets");
    if (!jo.is_array() || jo.size() != 2 || !jo[0].is_number_unsigned() ||
        !jo[1].is_number_unsigned())
      throw bad(
          fmt::format("tensor {} has data_offsets {}, not two integers >= 0", name, jo.dump()));
    const uint64_t begin = jo[0].get<uint64_t>(), end = jo[1].get<uint64_t>();
    const uint64_t nbytes = numel * dtype_size(dt);
    if (begin > end || end > data_size || end - begin != nbytes)
      throw CheckpointError(fmt::format(
          "checkpoint: '{}' is truncated or corrupt: tensor {} needs {} bytes at [{}, {}) of {}",
          path, name, nbytes, begin, end, data_size));
    tensors_.emplace(name, SafetensorsEntry{dt, std::move(shape), data + begin});
  }
}

MappedSafetensors::~MappedSafetensors() = default;

SafetensorsFile read_safetensors(const std::string& path) {
  const MappedSafetensors m(path);
  SafetensorsFile f;
  f.metadata = m.metadata();
  for (const auto& [name, e] : m.tensors()) {
    Tensor t = Tensor::empty(e.shape, e.dtype);
    std::memcpy(t.raw(), e.data, t.nbytes());
    f.tensors.emplace(name, std::move(t));
  }
  return f;
}

std::map<std::string, std::string> read_safetensors_metadata(const std::string& path) {
  return MappedSafetensors(path).metadata();
}

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<Planned>& tensors,
                                     const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header;
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::vector<std::pair<std::string, Place>> places;
  for (const Planned& t : tensors) {
    const uint64_t nbytes = static_cast<uint64_t>(shape_numel(t.shape)) * dtype_size(t.dtype);
    header[t.name] = {{"dtype", dtype_info(t.dtype).safetensors},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + nbytes}}};
    places.push_back({t.name, Place{offset, nbytes, false}});
    offset += nbytes;
  }
  const std::string h = header_json(header);
  const uint64_t hlen = h.size();
  file_ = std::make_unique<AtomicFile>(path);
  file_->write_at(0, &hlen, 8);
  file_->write_at(8, h.data(), h.size());
  for (auto& [name, p] : places) {
    p.offset += 8 + hlen;
    MT_CHECK(places_.emplace(name, p).second, "tensor {} planned twice in '{}'", name, path);
  }
}

SafetensorsWriter::~SafetensorsWriter() = default;

void SafetensorsWriter::write(const std::string& name, const void* bytes, size_t nbytes) {
  const auto it = places_.find(name);
  MT_CHECK(it != places_.end(), "tensor {} is not planned in '{}'", name, file_->path());
  MT_CHECK(it->second.nbytes == nbytes && !it->second.written,
           "tensor {} of '{}': {} bytes written, {} planned{}", name, file_->path(), nbytes,
           it->second.nbytes, it->second.written ? " (twice)" : "");
  file_->write_at(it->second.offset, bytes, nbytes);
  it->second.written = true;
}

void SafetensorsWriter::commit() {
  for (const auto& [name, p] : places_)
    MT_CHECK(p.written, "tensor {} of '{}' was never written", name, file_->path());
  file_->commit();
}

}  // namespace mt
