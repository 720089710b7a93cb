#include "train/checkpoint.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>

// Header-only: the checksums need no library at run time (the GPU machine has none).
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/parse.h"
#include "fsdp/fsdp.h"

namespace mt {

namespace {

// Visits every checkpointed tensor of the model and optimizer with its name.
template <class F>
void for_each_state(Qwen3Moe& model, AdamW& opt, F&& f) {
  size_t group_index = 0;
  for (auto& u : model.units())
    for (auto& g : u.groups) {
      if (g.sharded()) {
        const std::string name =
            u.name + (g.kind == ParamKind::kExpert ? ".experts" : ".dense") + ".shard";
        f(name, g.shard);
        f("optim.exp_avg." + name, opt.state()[2 * group_index]);
        f("optim.exp_avg_sq." + name, opt.state()[2 * group_index + 1]);
        ++group_index;
        continue;
      }
      for (size_t i = 0; i < g.specs.size(); ++i) {
        const std::string& name = g.specs[i].name;
        const int64_t off = g.specs[i].offset;
        f(name, g.param(i));
        f("optim.exp_avg." + name, opt.state()[2 * group_index].view(off, g.specs[i].shape));
        f("optim.exp_avg_sq." + name, opt.state()[2 * group_index + 1].view(off, g.specs[i].shape));
      }
      ++group_index;
    }
  for (size_t l = 0; l < model.router_biases().size(); ++l)
    f(fmt::format("buffers.layers.{}.router_bias", l), model.router_biases()[l]);
}

}  // namespace

std::optional<std::string> latest_checkpoint(const std::string& dir) {
  std::ifstream latest(std::filesystem::path(dir) / "latest");
  if (!latest) return std::nullopt;
  std::string name;
  latest >> name;
  return name;
}

namespace {
// Each tensor's bytes hashed (XXH3, 64 bits) into the metadata as "xxh3.<name>", checked on load:
// a flipped bit anywhere in a tensor is named instead of trained on.
std::string checksum_key(const std::string& name) {
  return "xxh3." + name;
}
std::string checksum(const Tensor& host) {
  return fmt::format("{:016x}", XXH3_64bits(host.raw(), host.nbytes()));
}

// The integer under `key` of a checkpoint file's metadata; CheckpointError naming both.
int64_t metadata_integer(const SafetensorsFile& f, const std::string& path, const char* key) {
  const auto it = f.metadata.find(key);
  const std::optional<int64_t> v = it == f.metadata.end() ? std::nullopt : parse_int64(it->second);
  if (!v)
    throw CheckpointError(fmt::format(
        "checkpoint: '{}' has {} metadata {}; it must be an integer", path, key,
        it == f.metadata.end() ? std::string("missing") : "'" + it->second.substr(0, 80) + "'"));
  return *v;
}

// The file's tensors are the model's, no more: a checkpoint of more layers, or one with an untied
// head resumed into a tied model, once loaded what it could and trained on. Names the
// unexpected tensors and the config fields their names say differ (the missing ones are named
// where they are looked for).
void check_no_unexpected_tensors(const std::string& path, const SafetensorsFile& f,
                                 const std::set<std::string>& expected, const ModelConfig& c) {
  std::vector<std::string> unexpected;
  int64_t layers = 0;
  bool head_out = false;
  for (const auto& [name, t] : f.tensors) {
    int64_t layer = -1;
    if (std::sscanf(name.c_str(), "layers.%ld.", &layer) == 1) layers = std::max(layers, layer + 1);
    head_out |= name.find("head.out") != std::string::npos;
    if (!expected.count(name)) unexpected.push_back(name);
  }
  if (unexpected.empty()) return;
  std::string fields;
  if (layers != c.n_layers)
    fields += fmt::format("; it holds {} layers, model.n_layers = {}", layers, c.n_layers);
  if (head_out && c.tie_word_embeddings)
    fields += "; it has an LM head of its own, and model.tie_word_embeddings = true";
  std::string names;
  for (size_t i = 0; i < std::min<size_t>(unexpected.size(), 4); ++i)
    names += (i ? ", " : "") + unexpected[i];
  throw CheckpointError(fmt::format(
      "checkpoint: '{}' holds {} tensor(s) this model lacks ({}{}){} (was it written for another "
      "model config?)",
      path, unexpected.size(), names, unexpected.size() > 4 ? ", ..." : "", fields));
}

bool multi_rank(const dist::Communicator* world) {
  return world && world->size() > 1;
}
std::string rank_file(int rank) {
  return fmt::format("rank_{}.safetensors", rank);
}
}  // namespace

CheckpointTarget checkpoint_target(const std::string& dir, int64_t step,
                                   const dist::Communicator* world) {
  namespace fs = std::filesystem;
  CheckpointTarget t;
  t.dir = dir;
  t.step = step;
  t.ranks = multi_rank(world) ? world->size() : 1;
  t.rank = multi_rank(world) ? world->rank() : 0;
  const std::string step_name = fmt::format("step_{:08d}", step);
  if (t.ranks > 1) {
    fs::create_directories(fs::path(dir) / step_name);
    t.published = (fs::path(dir) / step_name).string();
    t.file = (fs::path(t.published) / rank_file(t.rank)).string();
    t.latest = step_name;
  } else {
    fs::create_directories(dir);
    t.file = t.published = (fs::path(dir) / (step_name + ".safetensors")).string();
    t.latest = step_name + ".safetensors";
  }
  return t;
}

std::string CheckpointTarget::rank_path(int r) const {
  return ranks > 1 ? (std::filesystem::path(published) / rank_file(r)).string() : file;
}

namespace {
// The tensors of a checkpoint, for loops over them in parallel (a few hundred, up to gigabytes
// each: a thread per tensor keeps each checksum's order and uses every core on the rest).
std::vector<std::pair<const std::string*, const Tensor*>> tensor_list(
    const std::map<std::string, Tensor>& host) {
  std::vector<std::pair<const std::string*, const Tensor*>> out;
  for (const auto& [name, t] : host) out.emplace_back(&name, &t);
  return out;
}
}  // namespace

std::string first_non_finite(const std::map<std::string, Tensor>& host) {
  const auto list = tensor_list(host);
  std::vector<uint8_t> finite(list.size(), 1);
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < list.size(); ++i) finite[i] = all_finite(*list[i].second);
  for (size_t i = 0; i < list.size(); ++i)
    if (!finite[i]) return *list[i].first;  // the first by name, as a sequential scan finds
  return "";
}

NumericalError non_finite_state(const CheckpointTarget& t, const std::string& tensor) {
  const std::string last = latest_checkpoint(t.dir).value_or("");
  return NumericalError(fmt::format(
      "step {}: the model's state is not finite ({}{}); no checkpoint is written for this "
      "step, and '{}' (in {}) stays the last good one",
      t.step, tensor.empty() ? "on another rank" : "tensor " + tensor,
      t.ranks > 1 ? fmt::format(", rank {}", t.rank) : "", last.empty() ? "none" : last, t.dir));
}

void write_checkpoint_file(const CheckpointTarget& t, const std::map<std::string, Tensor>& host,
                           const TrainState& st, int64_t ep,
                           const std::map<std::string, std::string>& extra) {
  SafetensorsFile f;
  const auto list = tensor_list(host);
  std::vector<std::string> sums(list.size());
#pragma omp parallel for schedule(dynamic, 1)
  for (size_t i = 0; i < list.size(); ++i) sums[i] = checksum(*list[i].second);
  for (size_t i = 0; i < list.size(); ++i) {
    f.metadata[checksum_key(*list[i].first)] = sums[i];
    f.tensors.emplace(*list[i].first, *list[i].second);
  }
  f.metadata["format"] = "moetrain-checkpoint-1";
  f.metadata["step"] = std::to_string(st.step);
  f.metadata["data_position"] = format_data_state(st.data_position);
  f.metadata["world"] = std::to_string(t.ranks);
  f.metadata["rank"] = std::to_string(t.rank);
  f.metadata["ep"] = std::to_string(ep);
  f.metadata["run_id"] = std::to_string(st.run_id);
  for (const auto& [k, v] : extra) f.metadata[k] = v;
  write_safetensors(t.file, f);
}

void publish_checkpoint(const CheckpointTarget& t, int64_t keep) {
  write_file_atomically((std::filesystem::path(t.dir) / "latest").string(), t.latest + "\n");
  if (keep > 0) prune_checkpoints(t.dir, keep, t.step);
}

void for_each_checkpoint_tensor(Qwen3Moe& model, AdamW& opt,
                                const std::function<void(const std::string&, const Tensor&)>& f) {
  for_each_state(model, opt, f);
}

std::string save_checkpoint(const std::string& dir, Qwen3Moe& model, AdamW& opt,
                            const TrainState& st, dist::Communicator* world, int64_t keep) {
  const CheckpointTarget target = checkpoint_target(dir, st.step, world);
  std::map<std::string, Tensor> host;
  for_each_state(model, opt, [&](const std::string& name, const Tensor& t) {
    host.emplace(name, t.device() == Device::kCPU ? t : t.to(Device::kCPU));
  });
  // Never a poisoned checkpoint: every rank learns whether any rank's state is non-finite (a
  // sum over the ranks), and all of them stop with the same error, keeping the last good one.
  // (Host tensors: every backend takes them, NCCL through a device copy.)
  const std::string non_finite = first_non_finite(host);
  Tensor flag = Tensor::empty({1}, DType::kF64);
  flag.data<double>()[0] = non_finite.empty() ? 0.0 : 1.0;
  if (multi_rank(world)) world->all_reduce(flag);
  if (flag.data<double>()[0] > 0) throw non_finite_state(target, non_finite);
  write_checkpoint_file(target, host, st, model.mesh() ? model.mesh()->ep_size() : 1);
  // `latest` moves only once every rank's file is complete.
  if (multi_rank(world)) world->barrier();
  if (target.rank == 0) publish_checkpoint(target, keep);
  return target.published;
}

std::unique_ptr<DirectoryLock> DirectoryLock::try_acquire(const std::string& dir,
                                                          std::string* holder) {
  const std::string path = (std::filesystem::path(dir) / ".moetrain.lock").string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0)
    throw ConfigError(fmt::format("config: checkpoint.dir = '{}': cannot create its lock '{}': {}",
                                  dir, path, std::strerror(errno)));
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    char text[256] = {};
    const ssize_t n = ::pread(fd, text, sizeof(text) - 1, 0);
    *holder = n > 0 ? std::string(text, static_cast<size_t>(n)) : std::string("an unknown run");
    while (!holder->empty() && holder->back() == '\n') holder->pop_back();
    ::close(fd);
    return nullptr;
  }
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  const std::string me = fmt::format("pid {} on host {}\n", ::getpid(), host);
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) < 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(
        fmt::format("checkpoint: cannot write the lock '{}': {}", path, std::strerror(err)));
  }
  return std::unique_ptr<DirectoryLock>(new DirectoryLock(fd));
}

DirectoryLock::~DirectoryLock() {
  ::close(fd_);  // releases the flock; the file stays (removing it would race a new holder)
}

std::vector<std::pair<int64_t, std::string>> checkpoints_in(const std::string& dir) {
  namespace fs = std::filesystem;
  std::vector<std::pair<int64_t, std::string>> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.size() < 13 || name.rfind("step_", 0) != 0) continue;
    const std::string digits = name.substr(5, 8);
    const std::string rest = name.substr(13);
    if (rest != "" && rest != ".safetensors") continue;
    if (const std::optional<int64_t> step = parse_int64(digits); step && *step >= 0)
      out.emplace_back(*step, entry.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void prune_checkpoints(const std::string& dir, int64_t keep, int64_t published) {
  std::vector<std::pair<int64_t, std::string>> older;
  for (auto& c : checkpoints_in(dir))
    if (c.first <= published) older.push_back(std::move(c));
  for (size_t i = 0; i + static_cast<size_t>(keep) < older.size(); ++i) {
    std::error_code ec;
    std::filesystem::remove_all(older[i].second, ec);
    if (ec)
      throw IoError(fmt::format("checkpoint: cannot remove '{}' (checkpoint.keep = {}): {}",
                                older[i].second, keep, ec.message()));
  }
}

namespace {
// The loader's state from a file's metadata: integers >= 0 separated by commas.
DataState data_position(const SafetensorsFile& f, const std::string& path) {
  const auto it = f.metadata.find("data_position");
  if (it == f.metadata.end())
    throw CheckpointError(fmt::format("checkpoint: '{}' lacks data_position metadata", path));
  const std::optional<DataState> s = parse_data_state(it->second);
  if (!s)
    throw CheckpointError(fmt::format(
        "checkpoint: '{}' has data_position {}; it must be integers >= 0 separated by commas", path,
        it->second.substr(0, 80)));
  return *s;
}
}  // namespace

namespace {
// Every rank read its own file; before any rank touches its model or starts a collective of
// training, they compare what the files say (one all-gather of [step, recorded rank, run id]):
// files from two different steps or runs, or one rank's file copied as another's, stop every
// rank with the same error instead of leaving some waiting for a collective the others never
// start. Files from before the rank or the run was recorded (-1, 0) skip that comparison.
void check_ranks_agree(const std::string& path, const SafetensorsFile& f, const TrainState& st,
                       dist::Communicator& world) {
  const auto recorded = f.metadata.find("rank");
  Tensor mine = Tensor::empty({3}, DType::kI64);
  mine.data<int64_t>()[0] = st.step;
  mine.data<int64_t>()[1] = recorded == f.metadata.end() ? -1 : metadata_integer(f, path, "rank");
  mine.data<int64_t>()[2] = st.run_id;
  Tensor all = Tensor::empty({3 * world.size()}, DType::kI64);  // host: NCCL copies it over
  world.all_gather(mine, all);
  const int64_t* v = all.data<int64_t>();
  for (int r = 0; r < world.size(); ++r) {
    if (v[3 * r] != v[0])
      throw CheckpointError(fmt::format(
          "checkpoint: the ranks' files are from different steps: rank 0's is step {}, rank {}'s "
          "step {} (this rank read '{}'); every rank must resume from the same checkpoint",
          v[0], r, v[3 * r], path));
    if (v[3 * r + 1] >= 0 && v[3 * r + 1] != r)
      throw CheckpointError(
          fmt::format("checkpoint: rank {} read a file written by rank {} (this rank read '{}')", r,
                      v[3 * r + 1], path));
    if (v[3 * r + 2] != 0 && v[2] != 0 && v[3 * r + 2] != v[2])
      throw CheckpointError(fmt::format(
          "checkpoint: the ranks' files are from different runs: rank 0's run {:016x}, rank {}'s "
          "{:016x} (this rank read '{}'); every rank must resume from the same checkpoint",
          static_cast<uint64_t>(v[2]), r, static_cast<uint64_t>(v[3 * r + 2]), path));
  }
}
}  // namespace

namespace {

// --- resharding: a checkpoint written at another (W, ep) -------------------------------------

// The three flat buffers a group's state lives in: parameters, and AdamW's two moments, as the
// files name them ("" for the parameters).
constexpr std::array<const char*, 3> kStates = {"", "optim.exp_avg.", "optim.exp_avg_sq."};

// Every rank file of a checkpoint written by `world` ranks (one file when world is 1), checked
// to be one checkpoint: the same step and run, each file its rank's.
std::vector<SafetensorsFile> read_all_ranks(const std::string& path, int64_t* world, int64_t* ep) {
  namespace fs = std::filesystem;
  std::vector<SafetensorsFile> files;
  if (!fs::is_directory(path)) {
    files.push_back(read_safetensors(path));
  } else {
    files.push_back(read_safetensors((fs::path(path) / rank_file(0)).string()));
  }
  const auto meta = [&](const SafetensorsFile& f, const char* key) -> int64_t {
    return metadata_integer(f, path, key);
  };
  *world = meta(files[0], "world");
  *ep = meta(files[0], "ep");
  if (*world < 1 || *ep < 1 || *world % *ep != 0 || *world > dist::kMaxWorld ||
      (*world > 1) != fs::is_directory(path))
    throw CheckpointError(fmt::format("checkpoint: '{}' says world {}, ep {}", path, *world, *ep));
  for (int64_t r = 1; r < *world; ++r)
    files.push_back(read_safetensors((fs::path(path) / rank_file(static_cast<int>(r))).string()));
  for (int64_t r = 0; r < *world; ++r) {
    const SafetensorsFile& f = files[r];
    for (const auto& [name, t] : f.tensors)
      if (const auto sum = f.metadata.find(checksum_key(name)); sum != f.metadata.end())
        if (checksum(t) != sum->second)
          throw CheckpointError(fmt::format(
              "checkpoint: '{}': rank {}'s tensor {} fails its checksum: the file is corrupt", path,
              r, name));
    if (meta(f, "step") != meta(files[0], "step") ||
        meta(f, "run_id") != meta(files[0], "run_id") ||
        data_position(f, path) != data_position(files[0], path) || meta(f, "rank") != r)
      throw CheckpointError(fmt::format(
          "checkpoint: '{}': rank {}'s file is not of the same checkpoint as rank 0's (step, run "
          "or rank differ)",
          path, r));
  }
  return files;
}

const Tensor& file_tensor(const std::vector<SafetensorsFile>& files, int64_t rank,
                          const std::string& name, const std::string& path) {
  const auto it = files[rank].tensors.find(name);
  if (it == files[rank].tensors.end())
    throw CheckpointError(fmt::format(
        "checkpoint: '{}': rank {}'s file lacks tensor {} (written for another model config?)",
        path, rank, name));
  return it->second;
}

// A group's flat buffer (one of kStates) as rank `holder`'s view of it in the old layout: the
// shards of `members` laid end to end, or the unsharded specs of `holder` (old_specs: the specs
// with their old shapes and offsets).
Tensor old_flat(const std::vector<SafetensorsFile>& files, const std::vector<int64_t>& members,
                const std::string& shard_name, const std::vector<ParamSpec>& old_specs,
                const std::string& prefix, const std::string& path) {
  if (members.size() > 1) {
    std::vector<Tensor> parts;
    int64_t total = 0;
    for (const int64_t r : members) {
      parts.push_back(file_tensor(files, r, prefix + shard_name, path).to(DType::kF64));
      total += parts.back().numel();
    }
    Tensor flat = Tensor::empty({total}, DType::kF64);
    int64_t at = 0;
    for (const Tensor& t : parts) {
      Tensor dst = flat.view(at, {t.numel()});
      dst.copy_from(t);
      at += t.numel();
    }
    return flat;
  }
  int64_t numel = 0;
  for (const ParamSpec& s : old_specs) numel = std::max(numel, s.offset + shape_numel(s.shape));
  Tensor flat = Tensor::zeros({numel}, DType::kF64);
  for (const ParamSpec& s : old_specs) {
    const Tensor& t = file_tensor(files, members[0], prefix + s.name, path);
    if (t.shape() != s.shape)
      throw CheckpointError(fmt::format("checkpoint: '{}': tensor {} is {}, expected {}", path,
                                        prefix + s.name, shape_str(t.shape()), shape_str(s.shape)));
    Tensor dst = flat.view(s.offset, {t.numel()});
    dst.copy_from(t.to(DType::kF64));
  }
  return flat;
}

// Loads a checkpoint of another (W, ep) into this rank's shards: every rank reads every file,
// rebuilds each parameter and moment whole (every expert), and keeps its part.
TrainState load_resharded(const std::string& path, Qwen3Moe& model, AdamW& opt) {
  int64_t old_world = 1, old_ep = 1;
  const std::vector<SafetensorsFile> files = read_all_ranks(path, &old_world, &old_ep);
  TrainState st;  // integers, checked by read_all_ranks
  st.step = metadata_integer(files[0], path, "step");
  st.data_position = data_position(files[0], path);
  st.run_id = metadata_integer(files[0], path, "run_id");
  if (st.step < 0)
    throw CheckpointError(
        fmt::format("checkpoint: '{}' has step {}; it must be >= 0", path, st.step));
  const ModelConfig& c = model.config();
  if (c.n_experts % old_ep != 0)
    throw CheckpointError(
        fmt::format("checkpoint: '{}' has ep {} for {} experts", path, old_ep, c.n_experts));
  const int64_t old_local = c.n_experts / old_ep, old_dp = old_world / old_ep;
  std::vector<int64_t> everyone(old_world);
  for (int64_t r = 0; r < old_world; ++r) everyone[r] = r;
  size_t group_index = 0;
  // Every value first, the writes after: a missing tensor leaves the model as it was.
  struct Write {
    Tensor* flat;
    int64_t begin;
    const ParamSpec* spec;
    Tensor value;
  };
  std::vector<Write> writes;
  for (auto& u : model.units())
    for (auto& g : u.groups) {
      const bool experts = g.kind == ParamKind::kExpert;
      const std::string shard_name = u.name + (experts ? ".experts" : ".dense") + ".shard";
      // The old layout of this group's specs: expert specs hold old_local experts.
      std::vector<ParamSpec> old_specs = g.specs;
      int64_t offset = 0;
      for (ParamSpec& s : old_specs) {
        if (experts) s.shape[0] = old_local;
        s.offset = offset;
        offset += shape_numel(s.shape);
      }
      Tensor* targets[3] = {&g.shard, &opt.state()[2 * group_index],
                            &opt.state()[2 * group_index + 1]};
      for (size_t k = 0; k < kStates.size(); ++k) {
        // The whole value of each spec: dense from every rank (or rank 0 alone, unsharded);
        // experts from each old EP rank p's dp group (ranks p, p + ep, ...), blocks laid end to
        // end over p.
        std::vector<Tensor> whole(g.specs.size());
        if (!experts) {
          const Tensor flat = old_flat(files, old_world > 1 ? everyone : std::vector<int64_t>{0},
                                       shard_name, old_specs, kStates[k], path);
          for (size_t i = 0; i < g.specs.size(); ++i)
            whole[i] = flat.view(old_specs[i].offset, old_specs[i].shape);
        } else {
          for (size_t i = 0; i < g.specs.size(); ++i) {
            Shape all = g.specs[i].shape;
            all[0] = c.n_experts;
            whole[i] = Tensor::empty(all, DType::kF64);
          }
          for (int64_t p = 0; p < old_ep; ++p) {
            std::vector<int64_t> members;
            for (int64_t j = 0; j < old_dp; ++j) members.push_back(p + j * old_ep);
            const Tensor flat = old_flat(files, members, shard_name, old_specs, kStates[k], path);
            for (size_t i = 0; i < g.specs.size(); ++i) {
              const int64_t n = shape_numel(old_specs[i].shape);
              Tensor dst = whole[i].view(p * n, {n});
              dst.copy_from(flat.view(old_specs[i].offset, {n}));
            }
          }
        }
        for (size_t i = 0; i < g.specs.size(); ++i) {
          const ParamSpec& s = g.specs[i];
          // This rank's experts: the spec's init_offset counts the experts before them.
          const Tensor mine = experts ? whole[i].view(s.init_offset, s.shape) : whole[i];
          writes.push_back({targets[k], g.shard_begin(), &s, mine.clone()});
        }
      }
      ++group_index;
    }
  for (const Write& w : writes) write_spec_slice(*w.flat, w.begin, *w.spec, w.value);
  for (size_t l = 0; l < model.router_biases().size(); ++l) {
    Tensor& b = model.router_biases()[l];
    b.copy_from(file_tensor(files, 0, fmt::format("buffers.layers.{}.router_bias", l), path));
  }
  for (auto& u : model.units())
    for (auto& g : u.groups) fsdp::drop_compute_copies(g);
  return st;
}

}  // namespace

TrainState load_checkpoint(const std::string& path_in, Qwen3Moe& model, AdamW& opt,
                           dist::Communicator* world) {
  namespace fs = std::filesystem;
  std::string path = path_in;
  if (fs::is_directory(path))
    if (const std::optional<std::string> name = latest_checkpoint(path)) {
      if (name->empty())
        throw CheckpointError(fmt::format("checkpoint: '{}/latest' is empty", path));
      path = (fs::path(path) / *name).string();
    }
  const std::string world_now = std::to_string(multi_rank(world) ? world->size() : 1);
  const std::string ep_now = std::to_string(model.mesh() ? model.mesh()->ep_size() : 1);
  const std::string first =
      fs::is_directory(path) ? (fs::path(path) / rank_file(0)).string() : path;
  {
    // Written at another (W, ep): rebuilt whole from every rank's file, then re-sliced.
    SafetensorsFile head;
    head.metadata = read_safetensors_metadata(first);
    if (head.metadata["format"] != "moetrain-checkpoint-1")
      throw CheckpointError(fmt::format("checkpoint: '{}' is not a moetrain checkpoint", first));
    if (head.metadata["world"] != world_now || head.metadata["ep"] != ep_now) {
      if (!head.metadata.count("run_id"))
        throw CheckpointError(fmt::format(
            "checkpoint: '{}' was written with parallel.world = {}, parallel.ep = {} before "
            "checkpoints could be resharded; resume it with those (this run has world = {}, ep "
            "= {})",
            path, head.metadata["world"], head.metadata["ep"], world_now, ep_now));
      TrainState st = load_resharded(path, model, opt);
      if (multi_rank(world)) world->barrier();
      return st;
    }
  }
  if (fs::is_directory(path)) path = (fs::path(path) / rank_file(world->rank())).string();
  SafetensorsFile f = read_safetensors(path);
  if (f.metadata["format"] != "moetrain-checkpoint-1")
    throw CheckpointError(fmt::format("checkpoint: '{}' is not a moetrain checkpoint", path));
  // Check everything before touching the model: a mismatch leaves the model as it was.
  std::set<std::string> expected;
  for_each_state(model, opt,
                 [&](const std::string& name, const Tensor&) { expected.insert(name); });
  check_no_unexpected_tensors(path, f, expected, model.config());
  for_each_state(model, opt, [&](const std::string& name, const Tensor& t) {
    auto it = f.tensors.find(name);
    if (it == f.tensors.end())
      throw CheckpointError(
          fmt::format("checkpoint: '{}' lacks tensor {} (was it written for another model config?)",
                      path, name));
    if (it->second.shape() != t.shape() || it->second.dtype() != t.dtype())
      throw CheckpointError(
          fmt::format("checkpoint: '{}': tensor {} is {} {}, the model expects {} {}", path, name,
                      dtype_name(it->second.dtype()), shape_str(it->second.shape()),
                      dtype_name(t.dtype()), shape_str(t.shape())));
    // Checkpoints written before checksums carry none; theirs is not checked.
    if (const auto sum = f.metadata.find(checksum_key(name)); sum != f.metadata.end()) {
      const std::string computed = checksum(it->second);
      if (computed != sum->second)
        throw CheckpointError(fmt::format(
            "checkpoint: '{}': tensor {} fails its checksum (stored {}, computed {}): the file is "
            "corrupt",
            path, name, sum->second, computed));
    }
  });
  // The metadata first: a checkpoint refused here leaves the model as it was.
  TrainState st;
  st.step = metadata_integer(f, path, "step");
  st.data_position = data_position(f, path);
  if (f.metadata.count("run_id")) st.run_id = metadata_integer(f, path, "run_id");
  if (st.step < 0)
    throw CheckpointError(
        fmt::format("checkpoint: '{}' has step {}; it must be >= 0", path, st.step));
  if (multi_rank(world)) check_ranks_agree(path, f, st, *world);
  for_each_state(model, opt,
                 [&](const std::string& name, Tensor t) { t.copy_from(f.tensors.at(name)); });
  for (auto& u : model.units())
    for (auto& g : u.groups) g.compute = Tensor();  // stale: the next gather casts again
  return st;
}

}  // namespace mt
