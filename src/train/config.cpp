#include "train/config.h"

#include <toml++/toml.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <sstream>
#include <utility>

#include "core/error.h"
#include "model/precision.h"
#include "ops/route.h"

namespace mt {

namespace {

enum class FieldType { kInt, kFloat, kBool, kString, kFileList };
const char* type_name(FieldType t) {
  switch (t) {
    case FieldType::kInt:
      return "an integer";
    case FieldType::kFloat:
      return "a number";
    case FieldType::kBool:
      return "true or false";
    case FieldType::kString:
      return "a string";
    case FieldType::kFileList:
      return "a list of {path = \"...\", weight = w}";
  }
  return "?";
}

// A typed value read from TOML, already checked against the field's type.
struct Value {
  int64_t i = 0;
  double f = 0;
  bool b = false;
  std::string s;
  std::vector<DataFile> files;
};

struct Field {
  const char* section;
  const char* key;
  FieldType type;
  std::function<void(Config&, const Value&)> set;
};

template <class S, class T>
Field member(const char* sec, const char* key, S Config::*s, T S::*m) {
  FieldType t;
  if constexpr (std::is_same_v<T, bool>)
    t = FieldType::kBool;
  else if constexpr (std::is_integral_v<T>)
    t = FieldType::kInt;
  else if constexpr (std::is_floating_point_v<T>)
    t = FieldType::kFloat;
  else
    t = FieldType::kString;
  return {sec, key, t, [=](Config& c, const Value& v) {
            if constexpr (std::is_same_v<T, bool>)
              (c.*s).*m = v.b;
            else if constexpr (std::is_integral_v<T>) {
              if (!std::in_range<T>(v.i))
                throw ConfigError(fmt::format("config: {}.{} = {} is out of range", sec, key, v.i));
              (c.*s).*m = static_cast<T>(v.i);
            } else if constexpr (std::is_floating_point_v<T>)
              (c.*s).*m = v.f;
            else
              (c.*s).*m = v.s;
          }};
}

// A value as messages show it: its first 80 bytes (a 10 MB value is not echoed whole).
std::string shown(const std::string& v) {
  constexpr size_t kShown = 80;
  return v.size() <= kShown ? v : fmt::format("{}... ({} bytes)", v.substr(0, kShown), v.size());
}

// Strings (paths, names) hold no control characters: a newline once dropped what followed it and
// a NUL cut a path short without a word.
void check_no_control(const std::string& where, const std::string& v) {
  for (size_t i = 0; i < v.size(); ++i) {
    const auto c = static_cast<unsigned char>(v[i]);
    if (c < 0x20 || c == 0x7F)
      throw ConfigError(fmt::format(
          "config: {} holds a control character (byte {:#04x} at {}): '{}'; paths and names "
          "cannot",
          where, c, i, shown(v.substr(0, i))));
  }
}

std::string quoted_list(std::initializer_list<const char*> names) {
  std::string out;
  for (const char* n : names) out += (out.empty() ? "" : ", ") + std::string(n);
  return out;
}

const std::vector<Field>& fields() {
  using M = ModelConfig;
  using T = TrainConfig;
  using D = DataConfig;
  static const std::vector<Field> f = {
      member("model", "vocab_size", &Config::model, &M::vocab_size),
      member("model", "dim", &Config::model, &M::dim),
      member("model", "n_layers", &Config::model, &M::n_layers),
      member("model", "n_heads", &Config::model, &M::n_heads),
      member("model", "n_kv_heads", &Config::model, &M::n_kv_heads),
      member("model", "head_dim", &Config::model, &M::head_dim),
      member("model", "n_experts", &Config::model, &M::n_experts),
      member("model", "top_k", &Config::model, &M::top_k),
      member("model", "moe_dim", &Config::model, &M::moe_dim),
      member("model", "rope_theta", &Config::model, &M::rope_theta),
      member("model", "rms_norm_eps", &Config::model, &M::rms_norm_eps),
      member("model", "norm_topk_prob", &Config::model, &M::norm_topk_prob),
      member("model", "tie_word_embeddings", &Config::model, &M::tie_word_embeddings),
      member("model", "aux_loss_coef", &Config::model, &M::aux_loss_coef),
      member("model", "bias_update_rate", &Config::model, &M::bias_update_rate),
      {"model", "routing", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!ops::parse_routing_mode(v.s, &c.model.routing))
           throw ConfigError(fmt::format(
               "config: model.routing = \"{}\" (valid: learned, balanced, skewed)", shown(v.s)));
       }},
      member("model", "pad_expert_rows", &Config::model, &M::pad_expert_rows),
      member("model", "loss_chunk_tokens", &Config::model, &M::loss_chunk_tokens),
      member("model", "init_std", &Config::model, &M::init_std),
      {"model", "compute_dtype", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!parse_dtype(v.s, &c.model.compute_dtype))
           throw ConfigError(fmt::format(
               "config: model.compute_dtype = \"{}\" is not a dtype (valid: f32, f64, bf16)",
               shown(v.s)));
       }},
      {"model", "router_dtype", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!parse_dtype(v.s, &c.model.router_dtype) ||
             (c.model.router_dtype != DType::kF32 && c.model.router_dtype != DType::kBF16))
           throw ConfigError(
               fmt::format("config: model.router_dtype = \"{}\" (valid: f32, bf16)", shown(v.s)));
       }},
      {"model", "checkpoint", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!parse_policy(v.s, &c.model.checkpoint))
           throw ConfigError(fmt::format(
               "config: model.checkpoint = \"{}\" (valid: none, selective, full)", shown(v.s)));
       }},
      {"model", "aux_loss_form", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!parse_enum(kAuxLossForms, v.s, &c.model.aux_loss_form))
           throw ConfigError(
               fmt::format("config: model.aux_loss_form = \"{}\" (valid: per_layer, transformers)",
                           shown(v.s)));
       }},
      {"model", "expert_recipe", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!ops::parse_expert_recipe(v.s, &c.model.expert_precision.recipe))
           throw ConfigError(fmt::format(
               "config: model.expert_recipe = \"{}\" (valid: bf16, mxfp8, mxfp8_wgrad_with_hp, "
               "fp8_blockwise, fp8_wgrad_with_hp)",
               shown(v.s)));
       }},
      {"model", "dense_recipe", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!parse_enum(kDenseRecipes, v.s, &c.model.dense_recipe))
           throw ConfigError(fmt::format(
               "config: model.dense_recipe = \"{}\" (valid: bf16, fp8_wgrad_with_hp)", shown(v.s)));
       }},
      {"model", "fp8_scale", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!parse_fp8_scale_rule(v.s, &c.model.expert_precision.fp8_scale))
           throw ConfigError(
               fmt::format("config: model.fp8_scale = \"{}\" (valid: fp32, pow2)", shown(v.s)));
       }},
      {"model", "mx_scale_rule", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!parse_mx_scale_rule(v.s, &c.model.expert_precision.rule))
           throw ConfigError(fmt::format(
               "config: model.mx_scale_rule = \"{}\" (valid: rceil, floor)", shown(v.s)));
       }},
      {"model", "requant_dim1", FieldType::kBool,
       [](Config& c, const Value& v) { c.model.expert_precision.requant_dim1 = v.b; }},
      {"parallel", "ep_exchange", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!moe::parse_exchange_mode(v.s, &c.parallel.ep_exchange))
           throw ConfigError(fmt::format(
               "config: parallel.ep_exchange = \"{}\" (valid: device, host)", shown(v.s)));
       }},
      {"parallel", "ep_chunks", FieldType::kInt,
       [](Config& c, const Value& v) { c.parallel.ep_chunks = v.i; }},
      {"parallel", "ep_overlap", FieldType::kBool,
       [](Config& c, const Value& v) { c.parallel.ep_overlap = v.b; }},
      {"parallel", "reshard_after_forward", FieldType::kBool,
       [](Config& c, const Value& v) {
         c.parallel.reshard = v.b ? fsdp::Reshard::kAfterForward : fsdp::Reshard::kAfterBackward;
       }},
      {"parallel", "ep_dispatch_dtype", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!ops::parse_dispatch_dtype(v.s, &c.parallel.ep_dispatch_dtype))
           throw ConfigError(fmt::format(
               "config: parallel.ep_dispatch_dtype = \"{}\" (valid: bf16, mxfp8, fp8_blockwise)",
               shown(v.s)));
       }},
      {"model", "hf_config", FieldType::kString,
       [](Config& c, const Value& v) { c.model = model_config_from_hf_json(v.s, c.model); }},
      member("train", "steps", &Config::train, &T::steps),
      member("train", "seq_len", &Config::train, &T::seq_len),
      member("train", "batch_rows", &Config::train, &T::batch_rows),
      member("train", "grad_accum", &Config::train, &T::grad_accum),
      member("train", "lr", &Config::train, &T::lr),
      member("train", "min_lr_ratio", &Config::train, &T::min_lr_ratio),
      member("train", "warmup_steps", &Config::train, &T::warmup_steps),
      member("train", "weight_decay", &Config::train, &T::weight_decay),
      member("train", "beta1", &Config::train, &T::beta1),
      member("train", "beta2", &Config::train, &T::beta2),
      member("train", "eps", &Config::train, &T::eps),
      member("train", "grad_clip", &Config::train, &T::grad_clip),
      member("train", "seed", &Config::train, &T::seed),
      member("train", "log_every", &Config::train, &T::log_every),
      {"data", "source", FieldType::kString,
       [](Config& c, const Value& v) {
         if (v.s == "synthetic")
           c.data.source = DataSourceKind::kSynthetic;
         else if (v.s == "tokens")
           c.data.source = DataSourceKind::kTokens;
         else if (v.s == "sft")
           c.data.source = DataSourceKind::kSft;
         else
           throw ConfigError(fmt::format(
               "config: data.source = \"{}\" (valid: synthetic, tokens, sft)", shown(v.s)));
       }},
      member("data", "path", &Config::data, &D::path),
      {"data", "mix", FieldType::kFileList,
       [](Config& c, const Value& v) { c.data.mix = v.files; }},
      member("data", "shuffle", &Config::data, &D::shuffle),
      {"data", "packing", FieldType::kString,
       [](Config& c, const Value& v) {
         Packing p;
         if (!parse_packing(v.s, &p))
           throw ConfigError(
               fmt::format("config: data.packing = \"{}\" (valid: whole, stream)", shown(v.s)));
         c.data.packing = p;
       }},
      member("data", "pack_window", &Config::data, &D::pack_window),
      {"data", "overlong", FieldType::kString,
       [](Config& c, const Value& v) {
         if (!parse_overlong(v.s, &c.data.overlong))
           throw ConfigError(fmt::format(
               "config: data.overlong = \"{}\" (valid: truncate, drop, error)", shown(v.s)));
       }},
      member("data", "languages", &Config::data, &D::languages),
      member("data", "branching", &Config::data, &D::branching),
      member("data", "min_doc_len", &Config::data, &D::min_doc_len),
      member("data", "max_doc_len", &Config::data, &D::max_doc_len),
      member("data", "seed", &Config::data, &D::seed),
      member("checkpoint", "dir", &Config::checkpoint, &CheckpointConfig::dir),
      member("checkpoint", "every", &Config::checkpoint, &CheckpointConfig::every),
      member("checkpoint", "keep", &Config::checkpoint, &CheckpointConfig::keep),
      member("checkpoint", "async", &Config::checkpoint, &CheckpointConfig::async),
      member("checkpoint", "signal_deadline_s", &Config::checkpoint,
             &CheckpointConfig::signal_deadline_s),
      member("eval", "data", &Config::eval, &EvalConfig::data),
      member("eval", "every", &Config::eval, &EvalConfig::every),
      member("parallel", "world", &Config::parallel, &ParallelConfig::world),
      member("parallel", "ep", &Config::parallel, &ParallelConfig::ep),
      member("parallel", "cp", &Config::parallel, &ParallelConfig::cp),
      member("parallel", "ep_exchange_ctas", &Config::parallel, &ParallelConfig::ep_exchange_ctas),
      member("hardware", "device", &Config::hardware, &HardwareConfig::device),
      member("hardware", "peak_tflops", &Config::hardware, &HardwareConfig::peak_tflops),
      member("hardware", "threads", &Config::hardware, &HardwareConfig::threads),
      member("hardware", "cuda_graphs", &Config::hardware, &HardwareConfig::cuda_graphs),
      member("hardware", "overlap_optimizer", &Config::hardware,
             &HardwareConfig::overlap_optimizer),
  };
  return f;
}

std::string valid_keys(const std::string& section) {
  std::string out;
  for (const Field& f : fields())
    if (section == f.section) out += (out.empty() ? "" : ", ") + std::string(f.key);
  return out;
}

Value read_value(const toml::node& node, const Field& f) {
  Value v;
  const std::string where = fmt::format("{}.{}", f.section, f.key);
  auto wrong = [&]() {
    return ConfigError(fmt::format("config: {} must be {}", where, type_name(f.type)));
  };
  switch (f.type) {
    case FieldType::kInt:
      if (!node.is_integer()) throw wrong();
      v.i = node.as_integer()->get();
      break;
    case FieldType::kFloat:
      if (node.is_integer())
        v.f = static_cast<double>(node.as_integer()->get());
      else if (node.is_floating_point())
        v.f = node.as_floating_point()->get();
      else
        throw wrong();
      if (!std::isfinite(v.f))
        throw ConfigError(fmt::format("config: {} = {} must be a finite number", where, v.f));
      break;
    case FieldType::kBool:
      if (!node.is_boolean()) throw wrong();
      v.b = node.as_boolean()->get();
      break;
    case FieldType::kString:
      if (!node.is_string()) throw wrong();
      v.s = node.as_string()->get();
      check_no_control(where, v.s);
      break;
    case FieldType::kFileList: {
      const toml::array* list = node.as_array();
      if (!list || list->empty()) throw wrong();
      for (size_t i = 0; i < list->size(); ++i) {
        const toml::table* entry = list->get(i)->as_table();
        const std::string at = fmt::format("{}[{}]", where, i);
        if (!entry)
          throw ConfigError(
              fmt::format("config: {} must be a table {{path = \"...\", weight = w}}", at));
        for (const auto& [key, _] : *entry)
          if (key.str() != "path" && key.str() != "weight")
            throw ConfigError(
                fmt::format("config: unknown key {}.{} (valid: path, weight)", at, key.str()));
        const auto path = entry->get_as<std::string>("path");
        if (!path || path->get().empty())
          throw ConfigError(fmt::format("config: {}.path must name a token file", at));
        check_no_control(at + ".path", path->get());
        DataFile f{path->get(), 1.0};
        if (const toml::node* w = entry->get("weight")) {
          if (w->is_integer())
            f.weight = static_cast<double>(w->as_integer()->get());
          else if (w->is_floating_point())
            f.weight = w->as_floating_point()->get();
          else
            throw ConfigError(fmt::format("config: {}.weight must be a number", at));
        }
        if (!std::isfinite(f.weight) || f.weight <= 0)
          throw ConfigError(fmt::format("config: {}.weight = {} (the file '{}') must be > 0", at,
                                        f.weight, f.path));
        v.files.push_back(std::move(f));
      }
      break;
    }
  }
  return v;
}

void apply_table(const toml::table& root, Config& c) {
  static const char* kSections[] = {"model",      "train", "data",    "parallel",
                                    "checkpoint", "eval",  "hardware"};
  for (const auto& [k, node] : root) {
    const std::string section(k.str());
    if (std::find(std::begin(kSections), std::end(kSections), section) == std::end(kSections))
      throw ConfigError(fmt::format(
          "config: unknown section [{}] (valid: {})", section,
          quoted_list({"model", "train", "data", "parallel", "checkpoint", "eval", "hardware"})));
    if (!node.is_table())
      throw ConfigError(fmt::format("config: {} must be a table [{}]", section, section));
    const toml::table& t = *node.as_table();
    for (const auto& [key, _] : t)
      if (std::none_of(fields().begin(), fields().end(),
                       [&](const Field& f) { return section == f.section && key.str() == f.key; }))
        throw ConfigError(fmt::format("config: unknown key {}.{} (valid keys in [{}]: {})", section,
                                      key.str(), section, valid_keys(section)));
    // hf_config first, so that explicit keys in the same table override what it loaded.
    for (const Field& f : fields()) {
      if (section != f.section || std::string(f.key) != "hf_config") continue;
      if (const toml::node* n = t.get("hf_config")) f.set(c, read_value(*n, f));
    }
    for (const Field& f : fields()) {
      if (section != f.section || std::string(f.key) == "hf_config") continue;
      if (const toml::node* n = t.get(f.key)) f.set(c, read_value(*n, f));
    }
  }
}

toml::table parse_toml(const std::string& text, const std::string& name) {
  try {
    return toml::parse(text, name);
  } catch (const toml::parse_error& e) {
    throw ConfigError(fmt::format("config: {}:{}: {}", name, e.source().begin.line,
                                  std::string(e.description())));
  }
}

// "section.key=value" -> a one-key table. Values that are not TOML become strings.
toml::table parse_override(const std::string& o) {
  const size_t eq = o.find('=');
  const size_t dot = o.find('.');
  if (eq == std::string::npos || dot == std::string::npos || dot > eq)
    throw ConfigError(fmt::format("config: --set '{}' must look like section.key=value", shown(o)));
  const std::string section = o.substr(0, dot), key = o.substr(dot + 1, eq - dot - 1);
  const std::string value = o.substr(eq + 1);
  check_no_control("--set " + shown(o.substr(0, eq)), value);
  toml::table parsed;
  try {
    parsed = toml::parse("v = " + value);
  } catch (const toml::parse_error&) {
    parsed = toml::table{{"v", value}};
  }
  toml::table inner;
  inner.insert(key, *parsed.get("v"));
  toml::table outer;
  outer.insert(section, std::move(inner));
  return outer;
}

}  // namespace

void validate_config(const Config& c) {
  c.model.validate();
  const TrainConfig& t = c.train;
  auto positive = [](const char* key, int64_t v) {
    if (v <= 0) throw ConfigError(fmt::format("config: train.{} = {} must be > 0", key, v));
  };
  positive("steps", t.steps);
  positive("seq_len", t.seq_len);
  positive("batch_rows", t.batch_rows);
  positive("grad_accum", t.grad_accum);
  positive("log_every", t.log_every);
  // A micro-batch's tokens are indexed in 32 bits (positions, document bounds); a step holds at
  // most 2^20 micro-batches. Products in long double: no overflow on the way.
  const long double micro = static_cast<long double>(t.batch_rows) * t.seq_len;
  if (micro > static_cast<long double>(std::numeric_limits<int32_t>::max()))
    throw ConfigError(fmt::format(
        "config: train.batch_rows x train.seq_len = {} x {} tokens per micro-batch exceeds "
        "2147483647 (token indices are 32-bit); use fewer rows or shorter sequences",
        t.batch_rows, t.seq_len));
  if (t.grad_accum > (int64_t{1} << 20))
    throw ConfigError(fmt::format(
        "config: train.grad_accum = {} exceeds 1048576 micro-batches per step", t.grad_accum));
  if (!(t.lr > 0)) throw ConfigError(fmt::format("config: train.lr = {} must be > 0", t.lr));
  if (t.warmup_steps < 0) throw ConfigError("config: train.warmup_steps must be >= 0");
  if (t.min_lr_ratio < 0 || t.min_lr_ratio > 1)
    throw ConfigError(
        fmt::format("config: train.min_lr_ratio = {} must be in [0, 1]", t.min_lr_ratio));
  if (t.beta1 < 0 || t.beta1 >= 1 || t.beta2 < 0 || t.beta2 >= 1)
    throw ConfigError("config: train.beta1 and train.beta2 must be in [0, 1)");
  if (t.grad_clip < 0) throw ConfigError("config: train.grad_clip must be >= 0 (0 disables)");
  if (!(t.eps > 0)) throw ConfigError(fmt::format("config: train.eps = {} must be > 0", t.eps));
  if (t.weight_decay < 0)
    throw ConfigError(fmt::format("config: train.weight_decay = {} must be >= 0", t.weight_decay));
  const DataConfig& d = c.data;
  if (d.source == DataSourceKind::kSynthetic) {
    if (d.languages < 1 || d.branching < 1)
      throw ConfigError("config: data.languages and data.branching must be >= 1");
    if (d.min_doc_len < 2 || d.max_doc_len < d.min_doc_len)
      throw ConfigError(fmt::format(
          "config: data.min_doc_len = {} and data.max_doc_len = {} need 2 <= min <= max",
          d.min_doc_len, d.max_doc_len));
    const int64_t words = (c.model.vocab_size - d.languages) / 2;
    if (words < d.branching)
      throw ConfigError(
          fmt::format("config: model.vocab_size = {} is too small for data.languages = {} with "
                      "data.branching = {} (needs vocab_size >= languages + 2 * branching)",
                      c.model.vocab_size, d.languages, d.branching));
    if (!d.mix.empty())
      throw ConfigError("config: data.mix needs data.source = \"tokens\" or \"sft\" (token files)");
    if (d.resolved_packing() == Packing::kWhole)
      throw ConfigError(
          "config: data.packing = \"whole\" needs token files (data.source = \"tokens\" or "
          "\"sft\"); the synthetic languages are a stream");
  } else if (d.path.empty() && d.mix.empty()) {
    throw ConfigError(
        "config: data.path (or data.mix) must name a token file when data.source is not "
        "synthetic");
  } else if (!d.path.empty() && !d.mix.empty()) {
    throw ConfigError(
        fmt::format("config: data.path = '{}' and data.mix ({} files) both name the data; give one",
                    d.path, d.mix.size()));
  }
  if (d.pack_window < 1)
    throw ConfigError(
        fmt::format("config: data.pack_window = {} must be >= 1 (documents)", d.pack_window));
  c.parallel.validate(c.model.n_experts);
  if (const int64_t chunks = 2 * c.parallel.cp; t.seq_len % chunks != 0) {
    const int64_t below = t.seq_len / chunks * chunks;
    throw ConfigError(fmt::format(
        "config: train.seq_len = {} must be a multiple of 2 x parallel.cp = {} (each row is dealt "
        "to the cp ranks in 2 cp equal chunks; nearest valid: {})",
        t.seq_len, chunks,
        below > 0 ? fmt::format("{} or {}", below, below + chunks) : std::to_string(chunks)));
  }
  plan_precision(c.model, c.parallel);  // the experts' recipe against the dispatch dtype
  if (c.checkpoint.every < 0) throw ConfigError("config: checkpoint.every must be >= 0");
  if (c.checkpoint.keep < 0)
    throw ConfigError(
        fmt::format("config: checkpoint.keep = {} must be >= 0 (0: keep all)", c.checkpoint.keep));
  if (c.checkpoint.signal_deadline_s < 0)
    throw ConfigError(
        fmt::format("config: checkpoint.signal_deadline_s = {} must be >= 0 (0: no deadline)",
                    c.checkpoint.signal_deadline_s));
  if (c.eval.every < 0)
    throw ConfigError(fmt::format("config: eval.every = {} must be >= 0", c.eval.every));
  if (c.eval.every > 0 && c.eval.data.empty())
    throw ConfigError("config: eval.every > 0 needs eval.data (a token file)");
  const std::string& dev = c.hardware.device;
  if (dev != "auto" && dev != "cpu" && dev != "cuda")
    throw ConfigError(
        fmt::format("config: hardware.device = \"{}\" (valid: auto, cpu, cuda)", dev));
  if (c.hardware.threads < 0 || c.hardware.threads > kMaxThreads)
    throw ConfigError(fmt::format("config: hardware.threads = {} must be in [0, {}] (0: all cores)",
                                  c.hardware.threads, kMaxThreads));
}

Config parse_config_string(const std::string& text, const std::vector<std::string>& overrides,
                           const std::string& name) {
  Config c;
  apply_table(parse_toml(text, name), c);
  for (const std::string& o : overrides) apply_table(parse_override(o), c);
  validate_config(c);
  c.source = name;
  return c;
}

Config load_config(const std::string& path, const std::vector<std::string>& overrides) {
  std::string text;
  if (!path.empty()) {
    std::error_code ec;
    if (std::filesystem::is_directory(path, ec))
      throw ConfigError(
          fmt::format("config: '{}' is a directory; --config takes a TOML file", path));
    std::ifstream in(path);
    if (!in) throw ConfigError(fmt::format("config: cannot open '{}'", path));
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  return parse_config_string(text, overrides, path.empty() ? "defaults" : path);
}

}  // namespace mt
