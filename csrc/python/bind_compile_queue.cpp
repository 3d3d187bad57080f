// _C.compile_queue_*: the process-wide compile queue; pydflash/compile_queue.py is the API.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/compile_queue.h"
#include "python/bindings.h"
#include "python/gil.h"
#include "python/timeout.h"

namespace py = pybind11;

namespace pydflash::python {
namespace {

// A Python BaseException that is not an Exception (KeyboardInterrupt, SystemExit) left
// the holder's work: the holder was interrupted, so the key goes to a waiter instead of
// failing everyone (Note [Compile queue fairness]).
struct HolderInterrupted : CompileQueueInterrupted {
  explicit HolderInterrupted(py::error_already_set e) : error(std::move(e)) {}
  py::error_already_set error;
};

// Results are dropped by whichever caller lets go last, maybe without the GIL.
CompileResult hold(py::object value) {
  return CompileResult(new py::object(std::move(value)), [](void* p) {
    GilHeld gil;
    delete static_cast<py::object*>(p);
  });
}

// The holder's Python exception, carried to every caller. Not py::error_already_set:
// that one may be restored only once, and each waiter raises it again.
struct PythonError : std::exception {
  explicit PythonError(CompileResult exc) : exception(std::move(exc)) {}
  const char* what() const noexcept override { return "Python exception in compile-queue work"; }
  CompileResult exception;
};

[[noreturn]] void raise_held(const CompileResult& exception) {
  PyObject* value = static_cast<py::object*>(exception.get())->ptr();
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(value)), value);
  throw py::error_already_set();
}

// Note [One timeout rule]; None is -1, which `run` reads as the default.
double timeout_seconds(const py::object& timeout) {
  const double t = parse_timeout(timeout.ptr());
  if (t == -2.0) throw py::error_already_set();
  return t;
}

py::object run(const std::string& key, const py::object& fn, const std::string& slot,
               const std::string& label, const py::object& timeout) {
  PYDFLASH_CHECK_TYPE(PyCallable_Check(fn.ptr()), "expected a callable, got ",
                      std::string(py::str(py::type::of(fn).attr("__name__"))));
  CompileOptions options;
  options.slot = slot;
  options.label = label;
  options.timeout_s = timeout_seconds(timeout);
  auto work = [&fn]() -> CompileResult {
    GilHeld gil;
    try {
      return hold(fn());
    } catch (py::error_already_set& e) {
      if (!e.matches(PyExc_Exception)) throw HolderInterrupted(std::move(e));
      if (e.trace()) PyException_SetTraceback(e.value().ptr(), e.trace().ptr());
      throw PythonError(hold(e.value()));
    }
  };
  // Ctrl-C reaches the main thread's waits; the handler's exception stays set until
  // re-raised below.
  auto interrupted = [main = on_main_thread()] {
    if (!main) return false;  // only the main thread runs signal handlers
    GilHeld gil;
    return PyErr_CheckSignals() != 0;
  };
  CompileResult result;
  try {
    // Note [Never retaking the GIL at exit].
    result =
        without_gil([&] { return CompileQueue::instance().run(key, work, options, interrupted); });
  } catch (const PythonError& e) {
    raise_held(e.exception);
  } catch (HolderInterrupted& e) {
    throw std::move(e.error);
  } catch (const CompileQueueInterrupted&) {
    throw py::error_already_set();
  }
  return *static_cast<py::object*>(result.get());
}

py::dict key_stats(const CompileKeyStats& s) {
  py::dict d;
  d["runs"] = s.runs;
  d["shared"] = s.shared;
  d["waits"] = s.waits;
  d["failures"] = s.failures;
  d["wait_s"] = s.wait_ns * 1e-9;
  d["max_wait_s"] = s.max_wait_ns * 1e-9;
  d["run_s"] = s.run_ns * 1e-9;
  return d;
}

}  // namespace

void init_compile_queue(py::module_& m) {
  m.def("compile_queue_run", &run, py::arg("key"), py::arg("fn"), py::arg("slot"), py::arg("label"),
        py::arg("timeout"),
        "Runs fn() as the holder of `key`, or waits (without the GIL) for the holder's result.");
  m.def("compile_queue_stats", [] {
    std::map<std::string, CompileKeyStats> stats;
    // The queue's lock may be held by a thread wanting the GIL.
    stats = without_gil([] { return CompileQueue::instance().stats(); });
    py::dict out;
    for (const auto& [key, s] : stats) out[py::str(key)] = key_stats(s);
    return out;
  });
  m.def("compile_queue_reset_stats",
        [] { without_gil([] { CompileQueue::instance().reset_stats(); }); });
  m.def("compile_queue_in_flight", [] {
    std::vector<CompileFlightInfo> flights;
    flights = without_gil([] { return CompileQueue::instance().in_flight(); });
    py::list out;
    for (const auto& f : flights) {
      py::dict d;
      d["key"] = f.key;
      d["slot"] = f.slot;
      d["holder"] = f.holder;
      d["running"] = f.running;
      d["since_ns"] = f.since_ns;
      d["waiters"] = f.waiters;
      out.append(d);
    }
    return out;
  });
  m.def("compile_queue_set_timeout", [](const py::object& timeout) {
    const double t = timeout_seconds(timeout);
    without_gil([t] { CompileQueue::instance().set_default_timeout(t); });
  });
  m.def("compile_queue_timeout", [] {
    const double t = without_gil([] { return CompileQueue::instance().default_timeout(); });
    return t < 0 ? py::none() : py::object(py::float_(t));
  });
}

}  // namespace pydflash::python
