// Shared binding helpers: value-type structs get a keyword constructor, a readable __repr__ and
// field-wise __eq__ from the list of their bound field names.
#pragma once

#include <nanobind/nanobind.h>

#include <string>
#include <vector>

namespace zellige_bindings {

namespace nb = nanobind;

template <class T>
void add_value_methods(nb::class_<T>& cls, std::vector<std::string> fields) {
  const std::string type_name = nb::cast<std::string>(cls.attr("__name__"));
  cls.def(
      "__init__",
      [fields, type_name](T* self, nb::kwargs kwargs) {
        // Build on a temporary Python object so each field goes through its bound setter (type
        // conversion and errors as for attribute assignment).
        nb::object tmp = nb::cast(T());
        for (auto [key, value] : kwargs) {
          const std::string name = nb::cast<std::string>(key);
          bool known = false;
          for (const std::string& field : fields) known = known || field == name;
          if (!known) {
            throw nb::type_error(
                (type_name + "() got an unexpected keyword argument '" + name + "'").c_str());
          }
          nb::setattr(tmp, name.c_str(), value);
        }
        new (self) T(nb::cast<T>(tmp));
      },
      "Keyword constructor: every field is optional and named as the attribute.");
  cls.def("__repr__", [fields, type_name](nb::handle self) {
    std::string out = type_name + "(";
    for (size_t i = 0; i < fields.size(); ++i) {
      if (i > 0) out += ", ";
      out += fields[i] + "=" + nb::cast<std::string>(nb::repr(self.attr(fields[i].c_str())));
    }
    return out + ")";
  });
  cls.def("__eq__", [fields](nb::handle self, nb::handle other) -> nb::object {
    if (!nb::isinstance<T>(other)) return nb::borrow(Py_NotImplemented);
    for (const std::string& field : fields) {
      if (!self.attr(field.c_str()).equal(other.attr(field.c_str()))) return nb::bool_(false);
    }
    return nb::bool_(true);
  });
  cls.attr("__hash__") = nb::none();  // mutable value types: equal by value, so not hashable
}

}  // namespace zellige_bindings
