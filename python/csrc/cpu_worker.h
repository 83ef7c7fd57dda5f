// Every CPU handler's work runs on one thread of moekit's, one call at a time (ffi.cpp wraps each
// handler in OnWorker). XLA:CPU runs independent custom calls at once on its worker threads
// (route beside the aux-loss scores, a matmul's two gradients), and each of those threads would
// start an OpenMP team of its own: measured at qwen3 shapes on 2 cores, two teams of 2 threads
// each on the 2 cores, oversubscribed, and oneDNN's per-thread buffers twice
// (bench/results/jax_layer-cpu-2026-11-25). On one thread the calls get what the C++ layer has:
// one OpenMP team, every core for each call in turn. The hand-off costs a wake-up per call.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "ffi_common.h"

namespace moekit::python {

class CpuWorker {
 public:
  // The process's worker, started on first use and never stopped (it waits, asleep, between
  // calls; joining it at exit could wait on a caller that Python's shutdown left behind).
  static CpuWorker& get() {
    static CpuWorker* worker = new CpuWorker();
    return *worker;
  }

  // fn() on the worker thread; returns its result once it has run. Callers queue one at a time.
  ffi::Error run(const std::function<ffi::Error()>& fn) {
    std::lock_guard<std::mutex> one_call(calls_);
    std::unique_lock<std::mutex> lock(m_);
    job_ = &fn;
    ready_.notify_one();
    done_.wait(lock, [&] { return job_ == nullptr; });
    return std::move(result_);
  }

 private:
  CpuWorker() : thread_([this] { loop(); }) { thread_.detach(); }

  void loop() {
    std::unique_lock<std::mutex> lock(m_);
    for (;;) {
      ready_.wait(lock, [&] { return job_ != nullptr; });
      const std::function<ffi::Error()>* job = job_;
      lock.unlock();
      ffi::Error result = run_caught(*job);
      lock.lock();
      result_ = std::move(result);
      job_ = nullptr;
      done_.notify_one();
    }
  }

  // fn()'s result, or an internal error for an exception it let out (the handlers report
  // through Status, but an allocation inside the C++ core may still throw std::bad_alloc): an
  // exception leaving the worker thread would end the process.
  static ffi::Error run_caught(const std::function<ffi::Error()>& fn) {
    try {
      return fn();
    } catch (const std::exception& e) {
      return ffi::Error::Internal(std::string("moekit: ") + e.what());
    } catch (...) {
      return ffi::Error::Internal("moekit: an unknown C++ exception");
    }
  }

  std::mutex calls_, m_;
  std::condition_variable ready_, done_;
  const std::function<ffi::Error()>* job_ = nullptr;
  ffi::Error result_;
  std::thread thread_;
};

// OnWorker<fn>::call: the handler fn with the same arguments, run on the CpuWorker.
template <auto Fn>
struct OnWorker;
template <class... Args, ffi::Error (*Fn)(Args...)>
struct OnWorker<Fn> {
  static ffi::Error call(Args... args) {
    return CpuWorker::get().run([&] { return Fn(args...); });
  }
};

}  // namespace moekit::python
