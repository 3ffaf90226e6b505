// Python bindings of the engine's C++ CPU operators (ops.h), on CPython's C API with vectorcall entries.
//
// Why not pybind11: its headers and torch's Tensor casters (torch/csrc/utils/pybind.h) are most of a cold build:
// with them this file alone takes longer than every kernel together, and a first `serve run` on a machine waits for
// the slower unit (measurements: docs/cpu_kernels.md). Here it parses Python.h and the Tensor class only. Each
// operator's arguments are converted by its C++ parameter types (Arg<T>), so a new operator is one line in the
// table below. A call costs what a pybind11 call costs or less.
#include <Python.h>

#include <ATen/core/Tensor.h>

#include <exception>
#include <new>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "ops.h"

// torch's Python tensor, as torch/csrc/autograd/python_variable.h declares it and libtorch_python exports it. That
// header brings pybind11 and autograd's headers, slow to parse, so the three names are declared here. The build's
// name carries torch's version (cpu_ops.py), so another torch rebuilds against its own.
struct THPVariable {
  PyObject_HEAD
  at::Tensor cdata;
};
extern PyObject* THPVariableClass;
extern PyObject* ParameterClass;
PyObject* THPVariable_Wrap(at::TensorBase&& var);

namespace lora_serve::bindings_detail {

// An argument of the wrong Python type: raised to Python as TypeError.
struct ArgumentError : std::exception {
  std::string message;
  explicit ArgumentError(std::string text) : message(std::move(text)) {}
  const char* what() const noexcept override { return message.c_str(); }
};

inline std::string type_name(PyObject* value) { return Py_TYPE(value)->tp_name; }

inline bool is_tensor(PyObject* value) {
  PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(value));
  if (type == THPVariableClass || type == ParameterClass) return true;  // the common case, without a lookup
  if (THPVariableClass == nullptr) return false;  // torch's tensor type not set up: nothing is a Tensor yet
  int subclass = PyObject_IsInstance(value, THPVariableClass);
  if (subclass < 0) PyErr_Clear();
  return subclass > 0;
}

// Arg<T>::from(value, index): the Python argument at index as the C++ parameter type T, or ArgumentError.
template <typename T>
struct Arg;

// The tensor a Python object holds (is_tensor(value) checked first): a handle of its own to the same storage.
inline at::Tensor tensor_of(PyObject* value) { return reinterpret_cast<THPVariable*>(value)->cdata; }

template <>
struct Arg<at::Tensor> {
  static at::Tensor from(PyObject* value, size_t index) {
    if (!is_tensor(value))
      throw ArgumentError("argument " + std::to_string(index) + " must be a Tensor, not " + type_name(value));
    return tensor_of(value);
  }
};

template <>
struct Arg<std::optional<at::Tensor>> {
  static std::optional<at::Tensor> from(PyObject* value, size_t index) {
    if (value == Py_None) return std::nullopt;
    return Arg<at::Tensor>::from(value, index);
  }
};

template <>
struct Arg<std::vector<at::Tensor>> {
  static std::vector<at::Tensor> from(PyObject* value, size_t index) {
    if (!PyList_Check(value) && !PyTuple_Check(value))
      throw ArgumentError("argument " + std::to_string(index) + " must be a list of Tensors, not " +
                          type_name(value));
    std::vector<at::Tensor> tensors;
    for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(value); ++i) {  // a list's or a tuple's items, borrowed
      PyObject* item = PySequence_Fast_GET_ITEM(value, i);
      if (!is_tensor(item))
        throw ArgumentError("argument " + std::to_string(index) + " holds a " + type_name(item) + ", not a Tensor");
      tensors.push_back(tensor_of(item));
    }
    return tensors;
  }
};

template <>
struct Arg<int64_t> {
  static int64_t from(PyObject* value, size_t index) {
    if (!PyIndex_Check(value))  // int, bool or numpy's integers; never a float, which pybind11 refuses too
      throw ArgumentError("argument " + std::to_string(index) + " must be an int, not " + type_name(value));
    int64_t result = PyLong_AsLongLong(value);
    if (result == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      throw ArgumentError("argument " + std::to_string(index) + " does not fit 64 bits");
    }
    return result;
  }
};

template <>
struct Arg<double> {
  static double from(PyObject* value, size_t index) {
    if (!PyFloat_Check(value) && !PyIndex_Check(value))
      throw ArgumentError("argument " + std::to_string(index) + " must be a float, not " + type_name(value));
    return PyFloat_AsDouble(value);
  }
};

inline PyObject* to_python(at::Tensor&& tensor) { return THPVariable_Wrap(std::move(tensor)); }
inline PyObject* to_python(bool value) { return PyBool_FromLong(value); }
inline PyObject* to_python(int64_t value) { return PyLong_FromLongLong(value); }

// The GIL released for the scope, taken back however the scope ends (an operator's error included).
class WithoutGil {
 public:
  WithoutGil() : state_(PyEval_SaveThread()) {}
  ~WithoutGil() { PyEval_RestoreThread(state_); }
  WithoutGil(const WithoutGil&) = delete;
  WithoutGil& operator=(const WithoutGil&) = delete;

 private:
  PyThreadState* state_;
};

// Runs the operator without the GIL, as torch's own operators run: the replica's event loop (HTTP, Ray's calls)
// then runs beside a step's linears and attention instead of waiting for each to end, and the operators' own
// threads (work_pool.cpp) tolerate the core it takes. No operator touches a Python object. Beside threads that take
// the GIL, a replica decodes faster this way.
// The exception: an operator whose work is a few microseconds (a step's row gathers) keeps the GIL. Releasing it
// lets the replica's event loop take it, and the step thread then waits to take it back for longer than the
// operator runs.
enum class Gil { kRelease, kKeep };

template <Gil gil, typename R, typename... Params>
R invoke(R (*op)(Params...), std::decay_t<Params>&... values) {
  if constexpr (gil == Gil::kKeep) {
    return op(values...);
  } else {
    WithoutGil released;
    return op(values...);
  }
}

// Converts every argument first (left to right), then runs the operator on them as lvalues: an operator that
// writes a tensor in place (at::Tensor&) writes the caller's storage through its own handle.
template <Gil gil, typename R, typename... Params, size_t... I>
PyObject* run(R (*op)(Params...), PyObject* const* args, std::index_sequence<I...>) {
  std::tuple<std::decay_t<Params>...> values{Arg<std::decay_t<Params>>::from(args[I], I)...};
  if constexpr (std::is_void_v<R>) {
    invoke<gil>(op, std::get<I>(values)...);
    Py_RETURN_NONE;
  } else {
    return to_python(invoke<gil>(op, std::get<I>(values)...));
  }
}

// One operator's call from Python: positional arguments only; C++ errors become Python's (a failed
// TORCH_CHECK a RuntimeError with its message, as torch's own operators raise it).
template <Gil gil, typename R, typename... Params>
PyObject* call(const char* name, R (*op)(Params...), PyObject* const* args, Py_ssize_t count) {
  try {
    if (count != static_cast<Py_ssize_t>(sizeof...(Params)))
      throw ArgumentError("takes " + std::to_string(sizeof...(Params)) + " arguments (" + std::to_string(count) +
                          " given)");
    return run<gil>(op, args, std::index_sequence_for<Params...>{});
  } catch (const ArgumentError& error) {
    PyErr_Format(PyExc_TypeError, "%s: %s", name, error.what());
  } catch (const c10::Error& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what_without_backtrace());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
  }
  return nullptr;
}

}  // namespace lora_serve::bindings_detail

// A method table entry: the operator's name, a vectorcall entry converting its arguments by type, its docstring;
// the call releases the GIL (LORA_SERVE_OP) or keeps it (LORA_SERVE_OP_KEEPING_GIL).
#define LORA_SERVE_ENTRY(op, gil, doc)                                                                  \
  {#op,                                                                                                 \
   reinterpret_cast<PyCFunction>(+[](PyObject*, PyObject* const* args, Py_ssize_t count) -> PyObject* { \
     return lora_serve::bindings_detail::call<gil>(#op, &op, args, count);                              \
   }),                                                                                                  \
   METH_FASTCALL, doc}
#define LORA_SERVE_OP(op, doc) LORA_SERVE_ENTRY(op, lora_serve::bindings_detail::Gil::kRelease, doc)
#define LORA_SERVE_OP_KEEPING_GIL(op, doc) LORA_SERVE_ENTRY(op, lora_serve::bindings_detail::Gil::kKeep, doc)

static PyMethodDef operators[] = {
    LORA_SERVE_OP(paged_attention, "causal attention of decodes and prompt chunks, reading the paged KV cache in place"),
    LORA_SERVE_OP(prompt_attention, "causal attention of one sequence's bf16 prompt chunk, flash-style (AVX-512 BF16)"),
    LORA_SERVE_OP(bf16_prompt_attention, "whether this build has prompt_attention"),
    LORA_SERVE_OP(amx_prompt_attention, "whether prompt_attention runs on AMX (16-token blocks)"),
    LORA_SERVE_OP(vector_width, "floats per vector register: the attention block size is a multiple of it"),
    LORA_SERVE_OP(rotary, "rotary position embedding, transformers' rounding"),
    LORA_SERVE_OP(rms_norm, "weight * rms_norm(x), float32 inside, transformers' rounding"),
    LORA_SERVE_OP(add_rms_norm, "residual += delta in place, then weight * rms_norm(residual)"),
    LORA_SERVE_OP(silu_and_mul, "silu(gate) * up of x = [gate | up], transformers' rounding"),
    LORA_SERVE_OP(gelu_and_mul, "gelu(gate) * up of x = [gate | up] (tanh: the tanh approximation), ATen's GELU"),
    LORA_SERVE_OP(argmax_rows, "first index of each row's maximum, as torch.argmax(-1)"),
    LORA_SERVE_OP(log_normalizers, "each row's logsumexp in float32, as torch.logsumexp(-1)"),
    LORA_SERVE_OP_KEEPING_GIL(gather_rows, "rows of a 2-D table picked by index, as index_select(0, index)"),
    LORA_SERVE_OP(widen_, "x widened to float32 into out, on the operators' threads"),
    LORA_SERVE_OP(lora_add_, "multi-LoRA delta of one linear, each token reading its slot in place"),
    LORA_SERVE_OP(amx_linear_usable, "whether amx_linear takes a weight of [out, in] (AMX, multiples of 32)"),
    LORA_SERVE_OP(amx_pack_linear_weight, "a bf16 weight [out, in] in amx_linear's tile order"),
    LORA_SERVE_OP(amx_linear, "x W^T (+ bias) in bf16 on AMX tiles, for a decode step's few rows"),
    LORA_SERVE_OP(simd_linear_usable, "whether simd_linear takes this weight [out, in]"),
    LORA_SERVE_OP(simd_linear_widens_bf16, "whether simd_linear takes bf16 weights with float32 rows"),
    LORA_SERVE_OP(simd_pack_linear_weight, "a weight [out, in] in simd_linear's order"),
    LORA_SERVE_OP(simd_linear, "x W^T (+ bias) with AVX-512 (bf16, float32) or AVX2 (float32), without AMX"),
    LORA_SERVE_OP(grouped_simd_linear, "a mixture's experts: rows sorted by expert, each group times its weight"),
    LORA_SERVE_OP(parallel_for_count_, "the operators' parallel loop, counting the runs of each item"),
    LORA_SERVE_OP(write_kv_cache, "a step's new keys and values into their cache slots"),
    LORA_SERVE_OP(decoder_stack, "a Llama-family decoder's layers in one call, attention in place"),
    {nullptr, nullptr, 0, nullptr}};

// The module is named by the build (TORCH_EXTENSION_NAME, cpu_ops.build_name()); Python imports it as that name.
#define LORA_SERVE_CONCAT(a, b) a##b
#define LORA_SERVE_INIT(name) LORA_SERVE_CONCAT(PyInit_, name)
#define LORA_SERVE_TEXT(name) #name
#define LORA_SERVE_NAME(name) LORA_SERVE_TEXT(name)

static PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, LORA_SERVE_NAME(TORCH_EXTENSION_NAME),
                                        "the engine's C++ CPU operators", -1, operators};

PyMODINIT_FUNC LORA_SERVE_INIT(TORCH_EXTENSION_NAME)() { return PyModule_Create(&module_definition); }
