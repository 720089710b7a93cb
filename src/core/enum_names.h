// An enum's names in one table, read both ways: the config values and messages of a choice
// (MxScaleRule, ExpertRecipe, ...) come from the same place.
#pragma once
#include <array>
#include <cstddef>
#include <string_view>

namespace mt {

template <class E>
struct EnumName {
  E value;
  std::string_view name;
};

template <class E, size_t N>
constexpr std::string_view enum_name(const std::array<EnumName<E>, N>& table, E value) {
  for (const EnumName<E>& e : table)
    if (e.value == value) return e.name;
  return "?";
}

// False when `name` is none of the table's.
template <class E, size_t N>
constexpr bool parse_enum(const std::array<EnumName<E>, N>& table, std::string_view name, E* out) {
  for (const EnumName<E>& e : table)
    if (e.name == name) {
      *out = e.value;
      return true;
    }
  return false;
}

}  // namespace mt
