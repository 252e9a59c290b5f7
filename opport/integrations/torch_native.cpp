// opport's cpu kernels as native torch autograd nodes (opport/integrations/torch_native.py says when they run).
//
// A Python torch.autograd.Function costs tens of microseconds per forward + backward before any kernel runs; a
// decode-sized call's kernels take about ten. silu's and swiglu's larger calls, as torch's guest, split their loops
// over torch's own intra-op pool (at::parallel_for), the only threads free of torch's spinning workers. These nodes are C++ torch::autograd::Functions whose forward and
// backward call the fused loops' C entry points (opport/backends/cpu/_cfuncs.py) on the tensors' memory: the same
// loops, arguments and bits as the op files' small-call paths. Where a loop leaves elements or rows (NaN, inf,
// overflow), or the upstream gradient is not float32, the node calls the op's Python kernel for the whole call,
// which reruns the loop and the careful formula: the same result as the Python path, always. Under
// create_graph=True the backward is the Python one too (its gradients refuse a second backward).
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>

#include <atomic>
#include <memory>
#include <optional>

namespace py = pybind11;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;
using at::Tensor;

namespace {

constexpr int64_t kLanes = 64;  // opport.backends.cpu._fused.LANES (checked when the module is bound)

typedef int64_t (*Map1)(float*, float*, int64_t, uint8_t*);
typedef int64_t (*Map2)(float*, float*, float*, int64_t, uint8_t*);
typedef int64_t (*Map3x2)(float*, float*, float*, float*, float*, int64_t, uint8_t*);
typedef int64_t (*LnFwd)(float*, float*, float*, float*, int64_t, int64_t, float, uint8_t*, float*);
typedef int64_t (*RmsFwd)(float*, float*, float*, int64_t, int64_t, float, uint8_t*, float*);
typedef int64_t (*LnBwd)(float*, float*, double*, float*, double*, double*, int64_t, int64_t, double, uint8_t*,
                         double*);
typedef int64_t (*RmsBwd)(float*, float*, double*, float*, double*, int64_t, int64_t, double, uint8_t*, double*);
typedef int64_t (*AttnDecode)(float*, float*, float*, float*, float*, float*, int64_t, int64_t, int64_t, int64_t,
                              int64_t, int64_t, double, double, int64_t, int64_t);
typedef int64_t (*AddRmsBwd)(float*, float*, float*, double*, float*, double*, int64_t, int64_t, double, uint8_t*,
                             double*);

struct Entry {  // one op: its loops' C entry points and its Python kernels (forward, backward)
  void* forward = nullptr;
  void* backward = nullptr;
  PyObject* py_forward = nullptr;  // owned for the process's life (never released at exit, when no GIL is held)
  PyObject* py_backward = nullptr;
  void* rows_task = nullptr;  // rmsnorm's and add_rmsnorm's backward split over torch's pool (_cfunc_defs.py)
  void* cols_task = nullptr;
  void* decode = nullptr;  // attention's decode step
};
Entry silu_k, swiglu_k, layernorm_k, rmsnorm_k, add_rmsnorm_k, rope_k, attention_k;  // rope's, attention's: tasks

Entry& entry(const std::string& name) {
  if (name == "silu") return silu_k;
  if (name == "swiglu") return swiglu_k;
  if (name == "layernorm") return layernorm_k;
  if (name == "rmsnorm") return rmsnorm_k;
  if (name == "add_rmsnorm") return add_rmsnorm_k;
  if (name == "rope") return rope_k;
  if (name == "attention") return attention_k;
  throw std::invalid_argument("opport torch_native: no node for op " + name);
}

float* f32(const Tensor& t) { return t.data_ptr<float>(); }
int64_t ptr(const Tensor& t) { return reinterpret_cast<int64_t>(t.data_ptr<float>()); }

// The op's Python kernel on these arguments (tensors, then scalars): a list of tensors. Called with or without
// the GIL held (the autograd engine runs C++ nodes without it).
template <class... A>
std::vector<Tensor> python(PyObject* fn, A&&... args) {
  py::gil_scoped_acquire gil;
  return py::reinterpret_borrow<py::object>(fn)(std::forward<A>(args)...).template cast<std::vector<Tensor>>();
}

// Whether the loops take this upstream gradient: float32 (made contiguous first); another dtype goes to Python.
bool loop_grad(const Tensor& g) { return g.scalar_type() == at::kFloat; }

// An elementwise loop `run(offset, count)` over [0, n) in ranges of at least `grain` elements on torch's intra-op
// pool (one range, on this thread, where n <= grain): whether any range left elements. Each element's result is the
// loop's whatever range it falls in, so the split does not change a bit.
template <class F>
bool ranges(int64_t n, int64_t grain, F run) {
  std::atomic<bool> left{false};
  at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
    if (run(begin, end - begin)) left = true;
  });
  return left;
}

// Tasks [0, n) of a compiled task function (a numba cfunc `i64(i64 t, i64* ints, f64* floats)`:
// opport/backends/cpu/_attn_tasks.py) on torch's intra-op pool: the number of tasks that declined (returned non-zero).
// Each task writes memory of its own, so which thread runs it changes no bit.
typedef int64_t (*Task)(int64_t, int64_t*, double*);
int64_t pool_tasks(void* fn, int64_t n, int64_t* ints, double* floats) {
  std::atomic<int64_t> declined{0};
  Task task = reinterpret_cast<Task>(fn);
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      if (task(t, ints, floats)) declined++;
  });
  return declined;
}

// Each op's forward computation, shared by its autograd node and the calls that record nothing (decode).
Tensor silu_forward(const Tensor& x, int64_t grain) {
  Tensor y = at::empty_like(x);
  float *px = f32(x), *py = f32(y);
  if (ranges(x.numel(), grain, [&](int64_t o, int64_t n) {
        uint8_t flag = 0;
        return reinterpret_cast<Map1>(silu_k.forward)(px + o, py + o, n, &flag);
      }))
    y = python(silu_k.py_forward, x.detach())[0];
  return y;
}

Tensor swiglu_forward(const Tensor& gate, const Tensor& up, int64_t grain) {
  Tensor y = at::empty_like(gate);
  float *pg = f32(gate), *pu = f32(up), *py = f32(y);
  if (ranges(gate.numel(), grain, [&](int64_t o, int64_t n) {
        uint8_t flag = 0;
        return reinterpret_cast<Map2>(swiglu_k.forward)(pg + o, pu + o, py + o, n, &flag);
      }))
    y = python(swiglu_k.py_forward, gate.detach(), up.detach())[0];
  return y;
}

Tensor layernorm_forward(const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  Tensor y = at::empty_like(x);
  std::vector<uint8_t> bad(rows);
  std::vector<float> acc(kLanes);
  if (reinterpret_cast<LnFwd>(layernorm_k.forward)(f32(x), f32(w), f32(b), f32(y), rows, n, static_cast<float>(eps),
                                                   bad.data(), acc.data()))
    y = python(layernorm_k.py_forward, x.detach(), w.detach(), b.detach(), eps)[0];
  return y;
}

// rmsnorm's forward loop on rows of x into y, in ranges of rows of at least `grain` elements on torch's pool (rows are
// independent: the same bits however they split); `sum` (add_rmsnorm) first writes x = a + b, rounded once in float32
// as NumPy's np.add, over the same rows. Whether any row was left.
bool rms_forward_rows(void* fn, const float* a, const float* b, float* x, const Tensor& w, float* y, int64_t rows,
                      int64_t n, double eps, int64_t grain) {
  const float* pw = f32(w);
  return ranges(rows, std::max<int64_t>(1, grain / n), [&](int64_t r0, int64_t count) {
    if (a != nullptr)
      for (int64_t i = r0 * n; i < (r0 + count) * n; ++i) x[i] = a[i] + b[i];
    std::vector<uint8_t> bad(count);
    std::vector<float> acc(kLanes);
    return reinterpret_cast<RmsFwd>(fn)(x + r0 * n, const_cast<float*>(pw), y + r0 * n, count, n,
                                        static_cast<float>(eps), bad.data(), acc.data()) != 0;
  });
}

// rmsnorm with a weight and offset 0 (the Python side checks both)
Tensor rmsnorm_forward(const Tensor& x, const Tensor& w, double eps, int64_t grain) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  Tensor y = at::empty_like(x);
  if (rms_forward_rows(rmsnorm_k.forward, nullptr, nullptr, f32(x), w, f32(y), rows, n, eps, grain))
    y = python(rmsnorm_k.py_forward, x.detach(), w.detach(), eps)[0];
  return y;
}

// (normed, sum): the sum rounded once in float32 (NumPy's np.add), then rmsnorm of it
std::vector<Tensor> add_rmsnorm_forward(const Tensor& x, const Tensor& residual, const Tensor& w, double eps,
                                        int64_t grain) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  Tensor total = at::empty_like(x), y = at::empty_like(x);
  if (rms_forward_rows(add_rmsnorm_k.forward, f32(x), f32(residual), f32(total), w, f32(y), rows, n, eps, grain))
    return python(add_rmsnorm_k.py_forward, x.detach(), residual.detach(), w.detach(), eps);
  return {y, total};
}

// rmsnorm's backward loop (with a weight; h: add_rmsnorm's sum gradient, or undefined): {dx, dweight} with dweight
// summed in float64 over all rows in row order and rounded once, or nothing where a row was left. Calls of at least
// two `grain`s split over torch's pool: row tasks write dx and each row's 1 / rms, then column tasks sum dweight
// (each column's sum in row order): the serial loop's bits (_fused._rms_bwd_dx / _rms_dw_cols).
variable_list rms_backward(const Entry& k, const Tensor& x, const Tensor& g, const Tensor& h, const Tensor& w,
                           double eps, int64_t grain) {
  const int64_t n = x.size(-1), rows = x.numel() / n;
  Tensor dx = at::empty_like(x);
  Tensor w64 = w.to(at::kDouble), dw = at::zeros({n}, w64.options());
  std::vector<uint8_t> bad(rows);
  const int64_t tasks = std::min<int64_t>(rows, x.numel() / grain);
  if (tasks >= 2 && k.rows_task != nullptr) {
    Tensor rs = at::empty({rows}, w64.options());
    const int64_t per_row = (rows + tasks - 1) / tasks, per_col = ((n + tasks - 1) / tasks + 15) / 16 * 16;
    std::vector<int64_t> ints = {ptr(x), ptr(g), h.defined() ? ptr(h) : 0,
                                 reinterpret_cast<int64_t>(w64.data_ptr<double>()), ptr(dx),
                                 reinterpret_cast<int64_t>(dw.data_ptr<double>()),
                                 reinterpret_cast<int64_t>(rs.data_ptr<double>()),
                                 reinterpret_cast<int64_t>(bad.data()), rows, n, per_row, per_col};
    if (pool_tasks(k.rows_task, (rows + per_row - 1) / per_row, ints.data(), &eps)) return {};
    pool_tasks(k.cols_task, (n + per_col - 1) / per_col, ints.data(), &eps);
  } else {
    std::vector<double> scratch(kLanes + n);
    int64_t left = h.defined()
        ? reinterpret_cast<AddRmsBwd>(k.backward)(f32(x), f32(g), f32(h), w64.data_ptr<double>(), f32(dx),
                                                  dw.data_ptr<double>(), rows, n, eps, bad.data(), scratch.data())
        : reinterpret_cast<RmsBwd>(k.backward)(f32(x), f32(g), w64.data_ptr<double>(), f32(dx),
                                               dw.data_ptr<double>(), rows, n, eps, bad.data(), scratch.data());
    if (left) return {};
  }
  return {dx, dw.to(at::kFloat)};
}

// Every node's backward: under create_graph=True or for a gradient that is not float32, the op's Python kernel on
// (grad, args..., recorded); else `loops(g)` on the contiguous gradient, which returns the input gradients, or nothing
// where a loop left work (then the Python kernel on g). Last, no gradient for the forward's one scalar argument
// (grain or eps).
template <class Loops, class... A>
variable_list backward_of(const Entry& k, const Tensor& grad, Loops loops, const A&... args) {
  variable_list out;
  if (at::GradMode::is_enabled() || !loop_grad(grad)) {
    out = python(k.py_backward, grad, args..., at::GradMode::is_enabled());
  } else {
    Tensor g = grad.contiguous();
    out = loops(g);
    if (out.empty()) out = python(k.py_backward, g, args..., false);
  }
  out.emplace_back();
  return out;
}

struct Silu : public torch::autograd::Function<Silu> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, int64_t grain) {
    ctx->save_for_backward({x});
    ctx->saved_data["grain"] = grain;
    return silu_forward(x, grain);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    Tensor x = ctx->get_saved_variables()[0];
    const int64_t grain = ctx->saved_data["grain"].toInt();
    return backward_of(silu_k, grads[0], [&](const Tensor& g) -> variable_list {
      Tensor dx = at::empty_like(x);
      float *px = f32(x), *pg = f32(g), *pd = f32(dx);
      if (ranges(x.numel(), grain, [&](int64_t o, int64_t n) {
            uint8_t flag = 0;
            return reinterpret_cast<Map2>(silu_k.backward)(px + o, pg + o, pd + o, n, &flag);
          }))
        return {};
      return {dx};
    }, x);
  }
};

struct Swiglu : public torch::autograd::Function<Swiglu> {
  static Tensor forward(AutogradContext* ctx, const Tensor& gate, const Tensor& up, int64_t grain) {
    ctx->save_for_backward({gate, up});
    ctx->saved_data["grain"] = grain;
    return swiglu_forward(gate, up, grain);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &gate = saved[0], &up = saved[1];
    const int64_t grain = ctx->saved_data["grain"].toInt();
    return backward_of(swiglu_k, grads[0], [&](const Tensor& g) -> variable_list {
      Tensor dgate = at::empty_like(gate), dup = at::empty_like(up);
      float *pa = f32(gate), *pb = f32(up), *pg = f32(g), *pda = f32(dgate), *pdb = f32(dup);
      if (ranges(gate.numel(), grain, [&](int64_t o, int64_t n) {
            uint8_t flag = 0;
            return reinterpret_cast<Map3x2>(swiglu_k.backward)(pa + o, pb + o, pg + o, pda + o, pdb + o, n, &flag);
          }))
        return {};
      return {dgate, dup};
    }, gate, up);
  }
};

struct LayerNorm : public torch::autograd::Function<LayerNorm> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
    ctx->save_for_backward({x, w, b});
    ctx->saved_data["eps"] = eps;
    return layernorm_forward(x, w, b, eps);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1], &b = saved[2];
    const double eps = ctx->saved_data["eps"].toDouble();
    return backward_of(layernorm_k, grads[0], [&](const Tensor& g) -> variable_list {
      const int64_t n = x.size(-1), rows = x.numel() / n;
      Tensor dx = at::empty_like(x);
      Tensor w64 = w.to(at::kDouble), sums = at::zeros({2, n}, w64.options());  // dweight, dbias in float64
      std::vector<uint8_t> bad(rows);
      std::vector<double> scratch(2 * kLanes + n);
      if (reinterpret_cast<LnBwd>(layernorm_k.backward)(f32(x), f32(g), w64.data_ptr<double>(), f32(dx),
                                                        sums.data_ptr<double>(), sums.data_ptr<double>() + n, rows, n,
                                                        eps, bad.data(), scratch.data()))
        return {};
      return {dx, sums[0].to(at::kFloat), sums[1].to(at::kFloat)};
    }, x, w, b, eps);
  }
};

// rmsnorm with a weight and offset 0 (the Python side checks both); its backward in float64 as the Python path's:
// dweight summed over the call's rows in row order (rms_backward), then rounded once to float32.
struct RmsNorm : public torch::autograd::Function<RmsNorm> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& w, double eps, int64_t grain) {
    ctx->save_for_backward({x, w});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["grain"] = grain;
    return rmsnorm_forward(x, w, eps, grain);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &w = saved[1];
    const double eps = ctx->saved_data["eps"].toDouble();
    const int64_t grain = ctx->saved_data["grain"].toInt();
    variable_list out = backward_of(rmsnorm_k, grads[0], [&](const Tensor& g) -> variable_list {
      return rms_backward(rmsnorm_k, x, g, Tensor(), w, eps, grain);
    }, x, w, eps);
    out.emplace_back();  // grain
    return out;
  }
};

void bind(const std::string& name, int64_t forward, int64_t backward, py::object py_forward, py::object py_backward,
          int64_t lanes) {
  if (lanes != kLanes) throw std::invalid_argument("opport torch_native: LANES changed; rebuild the extension");
  Entry& e = entry(name);
  e.forward = reinterpret_cast<void*>(forward);
  e.backward = reinterpret_cast<void*>(backward);
  e.py_forward = py_forward.release().ptr();
  e.py_backward = py_backward.release().ptr();  // None for the forward-only ops
}

void bind_decode(int64_t decode) { attention_k.decode = reinterpret_cast<void*>(decode); }

void bind_split(const std::string& name, int64_t rows_task, int64_t cols_task) {
  Entry& e = entry(name);
  e.rows_task = reinterpret_cast<void*>(rows_task);
  e.cols_task = reinterpret_cast<void*>(cols_task);
}

// add_rmsnorm with a weight: (normed, sum); the backward from both outputs' gradients (an absent one is zeros) at the
// saved sum, dx = dresidual (one tensor, as the Python path's one array), dweight in float64 rounded once.
struct AddRmsNorm : public torch::autograd::Function<AddRmsNorm> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& residual, const Tensor& w,
                               double eps, int64_t grain) {
    std::vector<Tensor> out = add_rmsnorm_forward(x, residual, w, eps, grain);
    ctx->save_for_backward({out[1], w});
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["grain"] = grain;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &total = saved[0], &w = saved[1];
    const double eps = ctx->saved_data["eps"].toDouble();
    const int64_t grain = ctx->saved_data["grain"].toInt();
    Tensor gy = grads[0].defined() ? grads[0] : at::zeros_like(total);
    Tensor gh = grads[1].defined() ? grads[1] : at::zeros_like(total);
    // the sum's gradient rides as the Python kernel's second argument; the loop takes it in float32 only
    variable_list out = backward_of(add_rmsnorm_k, gy, [&](const Tensor& g) -> variable_list {
      if (!loop_grad(gh)) return {};
      variable_list r = rms_backward(add_rmsnorm_k, total, g, gh.contiguous(), w, eps, grain);
      if (r.empty()) return {};
      return {r[0], r[0], r[1]};
    }, gh, total, w, eps);
    out.emplace_back();  // grain
    return out;
  }
};

int64_t run_tasks(int64_t fn, int64_t n, int64_t ints, int64_t floats) {  // the cpu kernels' way in (GIL held)
  py::gil_scoped_release nogil;
  return pool_tasks(reinterpret_cast<void*>(fn), n, reinterpret_cast<int64_t*>(ints), reinterpret_cast<double*>(floats));
}

// rope (float32 x [B, H, S, D] of any strides whose last is 1, float32 tables [S, D/2] or [1 or B, S, D/2]): the
// rotation's row tasks (_cfunc_defs.rope_rows) in ranges of rows of at least `grain` elements on torch's pool, into a
// contiguous y. Rows are independent and elementwise (NaN and inf propagate as in the Python kernel: nothing to
// leave), so the bits are the Python path's however they split; the backward rotates the gradient by the same angles
// with the sine table negated (exact), as the Python kernel does.
void rope_rows(const Tensor& x, const Tensor& y, const Tensor& cos, const Tensor& sin, bool interleaved,
               int64_t grain) {
  const int64_t d = x.size(3), rows = x.numel() / std::max<int64_t>(d, 1);
  const int64_t per = std::max<int64_t>(1, grain / std::max<int64_t>(d, 1));
  std::vector<int64_t> ints = {ptr(x), ptr(y), ptr(cos), ptr(sin), x.size(0), x.size(1), x.size(2), d,
                               x.stride(0), x.stride(1), x.stride(2), cos.dim() == 3 ? cos.size(0) : 1,
                               static_cast<int64_t>(interleaved), per};
  double none = 0;
  pool_tasks(rope_k.forward, (rows + per - 1) / per, ints.data(), &none);
}

Tensor rope_forward(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, int64_t grain) {
  Tensor y = at::empty(x.sizes(), x.options());
  rope_rows(x.stride(3) == 1 ? x : x.contiguous(), y, cos.contiguous(), sin.contiguous(), interleaved, grain);
  return y;
}

struct Rope : public torch::autograd::Function<Rope> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved,
                        int64_t grain) {
    Tensor c = cos.contiguous(), s = sin.contiguous();
    Tensor y = rope_forward(x, c, s, interleaved, grain);
    ctx->save_for_backward({c, s});
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["grain"] = grain;
    return y;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &c = saved[0], &s = saved[1];
    const bool interleaved = ctx->saved_data["interleaved"].toBool();
    const int64_t grain = ctx->saved_data["grain"].toInt();
    variable_list out = backward_of(rope_k, grads[0], [&](const Tensor& g) -> variable_list {
      Tensor dx = at::empty_like(g);
      rope_rows(g, dx, c, s.neg(), interleaved, grain);
      return {dx};
    }, c, s, interleaved);
    out.resize(5);  // no gradient for the tables (constants), interleaved (backward_of's one) and grain
    return out;
  }
};

// opport's BLAS limiter (cpu/_common.py, Python): BLAS held to one thread while tasks run on torch's pool, as the
// Python path's kernels are as torch's guest (BLAS threads inside pool threads would fight torch's for the cores).
PyObject* blas_enter = nullptr;  // owned for the process's life
PyObject* blas_exit = nullptr;

void bind_blas(py::object enter, py::object exit) {
  blas_enter = enter.release().ptr();
  blas_exit = exit.release().ptr();
}

// Attention's tasks on the tensors' memory, on torch's pool (`pool`) or one after another on this thread (a budget of
// one thread), BLAS held to one thread, the GIL released if this thread holds it (the forward, called from Python;
// the autograd engine runs the backward without it): whether any task declined.
bool attention_tasks(void* fn, int64_t n, std::vector<int64_t>& ints, double scale, bool pool) {
  {
    py::gil_scoped_acquire gil;
    py::reinterpret_borrow<py::object>(blas_enter)(1);
  }
  int64_t declined = 0;
  {
    std::unique_ptr<py::gil_scoped_release> nogil;
    if (PyGILState_Check()) nogil = std::make_unique<py::gil_scoped_release>();
    if (pool) {
      declined = pool_tasks(fn, n, ints.data(), &scale);
    } else {
      Task task = reinterpret_cast<Task>(fn);
      for (int64_t t = 0; t < n && !declined; ++t) declined = task(t, ints.data(), &scale);
    }
  }
  py::gil_scoped_acquire gil;
  py::reinterpret_borrow<py::object>(blas_exit)(1);
  return declined != 0;
}

// The tasks' integer arguments (_attn_loops.py: NINT): q, k, v, out, lse, grad, dq, dk, dv addresses (undefined: 0),
// then B*Hkv, g, Sq, Sk, D, Dv, the query and key block, causal.
std::vector<int64_t> attention_ints(const std::vector<Tensor>& t, bool causal, int64_t bq, int64_t bk) {
  const Tensor &q = t[0], &k = t[1], &v = t[2];
  std::vector<int64_t> ints;
  for (const Tensor& a : t) ints.push_back(a.defined() ? ptr(a) : 0);
  ints.resize(9, 0);
  for (int64_t x : {k.size(0) * k.size(1), q.size(1) / k.size(1), q.size(2), k.size(2), q.size(3), v.size(3), bq, bk,
                    static_cast<int64_t>(causal)})
    ints.push_back(x);
  return ints;
}

// A decode step's attention (one query row per head, float32; keys [kstart, kend), softcap 0 for none) by the fused
// loop `_attn_decode` on contiguous q, k, v, as the cpu kernel's decode path: its output, or None where the loop
// declines (a non-finite score or output: the dispatcher's kernel then runs the call).
std::optional<Tensor> attention_decode(const Tensor& q, const Tensor& k, const Tensor& v, double scale, double softcap,
                                       int64_t kstart, int64_t kend) {
  Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const int64_t b = q.size(0), hq = q.size(1), d = q.size(3), hkv = k.size(1), sk = k.size(2), dv = v.size(3);
  Tensor out = at::empty({b, hq, 1, dv}, q.options()), lse = at::empty({b, hq, 1}, q.options());
  std::vector<float> s((hq / hkv) * sk);
  if (reinterpret_cast<AttnDecode>(attention_k.decode)(f32(qc), f32(kc), f32(vc), f32(out), f32(lse), s.data(), b, hq,
                                                       hkv, sk, d, dv, scale, softcap, kstart, kend))
    return std::nullopt;
  return out;
}

// float32 attention, causal or full, no soft cap or window (the Python side checks): the forward and backward tasks
// (opport/backends/cpu/_attn_loops.py) on contiguous copies of q, k, v made once and kept for the backward; blocks =
// (forward query block, forward key block, backward query block, backward key block, on torch's pool: 1/0). Where
// a task declines (non-finite values in a masked block, a row with no key), the op's Python kernel runs the whole
// call, as the Python path's kernels do: the same bits.
struct Attention : public torch::autograd::Function<Attention> {
  static Tensor forward(AutogradContext* ctx, const Tensor& q, const Tensor& k, const Tensor& v, bool causal,
                        double scale, std::vector<int64_t> blocks) {
    Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
    Tensor out = at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
    Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
    std::vector<int64_t> ints = attention_ints({qc, kc, vc, out, lse}, causal, blocks[0], blocks[1]);
    const int64_t n = k.size(0) * k.size(1) * ((q.size(2) + blocks[0] - 1) / blocks[0]);
    if (attention_tasks(attention_k.forward, n, ints, scale, blocks[4] != 0)) {
      std::vector<Tensor> r = python(attention_k.py_forward, qc, kc, vc, causal, scale);
      out = r[0];
      lse = r[1];
    }
    ctx->save_for_backward({qc, kc, vc, out, lse});
    ctx->saved_data["causal"] = causal;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["bq"] = blocks[2];
    ctx->saved_data["bk"] = blocks[3];
    ctx->saved_data["pool"] = blocks[4] != 0;
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const Tensor &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const bool causal = ctx->saved_data["causal"].toBool();
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t bq = ctx->saved_data["bq"].toInt(), bk = ctx->saved_data["bk"].toInt();
    const bool pool = ctx->saved_data["pool"].toBool();
    variable_list result = backward_of(attention_k, grads[0], [&](const Tensor& g) -> variable_list {
      Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
      std::vector<int64_t> ints = attention_ints({q, k, v, out, lse, g, dq, dk, dv}, causal, bq, bk);
      if (attention_tasks(attention_k.backward, k.size(0) * k.size(1), ints, scale, pool)) return {};
      return {dq, dk, dv};
    }, q, k, v, out, lse, causal, scale);
    result.resize(6);  // no gradient for causal, scale (backward_of's one) and blocks
    return result;
  }
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("bind", &bind);
  m.def("bind_split", &bind_split);
  m.def("bind_decode", &bind_decode);
  m.def("silu", [](const Tensor& x, int64_t grain) { return Silu::apply(x, grain); });
  m.def("swiglu", [](const Tensor& gate, const Tensor& up, int64_t grain) { return Swiglu::apply(gate, up, grain); });
  m.def("layernorm", [](const Tensor& x, const Tensor& w, const Tensor& b, double eps) {
    return LayerNorm::apply(x, w, b, eps);
  });
  m.def("rmsnorm", [](const Tensor& x, const Tensor& w, double eps, int64_t grain) {
    return RmsNorm::apply(x, w, eps, grain);
  });
  m.def("add_rmsnorm", [](const Tensor& x, const Tensor& residual, const Tensor& w, double eps, int64_t grain) {
    return AddRmsNorm::apply(x, residual, w, eps, grain);
  });
  // no node: for calls that record nothing (no grad mode, or no input requiring grad)
  m.def("silu_forward", &silu_forward);
  m.def("swiglu_forward", &swiglu_forward);
  m.def("layernorm_forward", &layernorm_forward);
  m.def("rmsnorm_forward", &rmsnorm_forward);
  m.def("add_rmsnorm_forward", &add_rmsnorm_forward);
  m.def("rope_forward", &rope_forward);
  m.def("attention_decode", &attention_decode);
  m.def("rope", [](const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved, int64_t grain) {
    return Rope::apply(x, cos, sin, interleaved, grain);
  });
  m.def("attention", [](const Tensor& q, const Tensor& k, const Tensor& v, bool causal, double scale,
                        std::vector<int64_t> blocks) { return Attention::apply(q, k, v, causal, scale, blocks); });
  m.def("bind_blas", &bind_blas);
  m.def("run_tasks", &run_tasks);
}
