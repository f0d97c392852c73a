// Per-device compute capability for vLLM's compiled library, installed by rewriting its PLT
// slots (GOT entries) in memory: get_sm_version_num() (vLLM 0.30/0.31 call it through the PLT)
// and the library's import of cudaDeviceGetAttribute (0.32+ inline get_sm_version_num and ask
// the runtime for device 0 directly). See docs/sm-hook.md for the mechanism and its limits.
//
// vLLM 0.30's _C_stable_libtorch defines `int get_sm_version_num()` (mangled
// _Z18get_sm_version_numv), which asks the CUDA runtime for the capability of device 0, and calls
// it from its CUTLASS/FP4/MoE dispatchers through the PLT, because the symbol has default
// visibility. Every call therefore jumps through one GOT slot described by an
// R_X86_64_JUMP_SLOT relocation. Pointing that slot at sm_version_current_device() below makes
// each of those call sites answer for the calling thread's current device.
//
// Nothing here includes a CUDA header or links the CUDA runtime: the two runtime functions the
// hook needs are declared below and resolved with dlsym at install time, through the hooked
// library's own dependencies (so the hook uses the same libcudart the library uses).

#include <dlfcn.h>
#include <elf.h>
#include <link.h>
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

namespace py = pybind11;

namespace {

// ---- the two CUDA runtime functions the hook calls (declared, never linked) -----------------
using CudaGetDevice = int (*)(int* device);
using CudaDeviceGetAttribute = int (*)(int* value, int attr, int device);
constexpr int kCudaDevAttrComputeCapabilityMajor = 75;
constexpr int kCudaDevAttrComputeCapabilityMinor = 76;
constexpr int kMaxDevices = 64;

std::atomic<CudaGetDevice> g_get_device{nullptr};
std::atomic<CudaDeviceGetAttribute> g_get_attribute{nullptr};
std::atomic<int> g_capability[kMaxDevices];  // major*10+minor per device; 0 = not asked yet
std::string g_runtime_path;                   // which library provides them (for reports)

#if defined(__x86_64__)
constexpr uint32_t kJumpSlot = R_X86_64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_X86_64_GLOB_DAT;
constexpr const char* kJumpSlotName = "R_X86_64_JUMP_SLOT";
#elif defined(__aarch64__)
constexpr uint32_t kJumpSlot = R_AARCH64_JUMP_SLOT;
constexpr uint32_t kGlobDat = R_AARCH64_GLOB_DAT;
constexpr const char* kJumpSlotName = "R_AARCH64_JUMP_SLOT";
#else
#error "sm_hook.cpp supports x86_64 and aarch64 ELF only"
#endif

}  // namespace

// The replacement for get_sm_version_num(): the capability of the calling thread's current CUDA
// device as major*10+minor, cached per device index. No Python, no locks, no GIL.
extern "C" int vllm_dualgpu_sm_version_current_device() {
  int device = 0;
  if (g_get_device.load(std::memory_order_acquire)(&device) != 0 || device < 0) {
    device = 0;  // what vLLM's own function would have answered
  }
  const bool cacheable = device < kMaxDevices;
  if (cacheable) {
    const int known = g_capability[device].load(std::memory_order_relaxed);
    if (known != 0) return known;
  }
  CudaDeviceGetAttribute get_attribute = g_get_attribute.load(std::memory_order_acquire);
  int major = 0, minor = 0;
  get_attribute(&major, kCudaDevAttrComputeCapabilityMajor, device);
  get_attribute(&minor, kCudaDevAttrComputeCapabilityMinor, device);
  const int version = major * 10 + minor;
  if (cacheable && version > 0) g_capability[device].store(version, std::memory_order_relaxed);
  return version;
}

// The replacement for the library's own import of cudaDeviceGetAttribute. From vLLM 0.32 the
// library inlines get_sm_version_num(): its dispatchers call cudaDeviceGetAttribute(&v, 75 or
// 76, 0) themselves, through the library's JUMP_SLOT for cudaDeviceGetAttribute. This answers
// the two compute-capability attributes asked for device 0 for the calling thread's current
// device instead; every other attribute and device goes to the runtime's function unchanged.
extern "C" int vllm_dualgpu_device_get_attribute(int* value, int attr, int device) {
  if (device == 0 &&
      (attr == kCudaDevAttrComputeCapabilityMajor || attr == kCudaDevAttrComputeCapabilityMinor)) {
    int current = 0;
    if (g_get_device.load(std::memory_order_acquire)(&current) == 0 && current > 0) device = current;
  }
  return g_get_attribute.load(std::memory_order_acquire)(value, attr, device);
}

namespace {

// ---- finding a loaded library and reading its dynamic section ------------------------------

struct LoadedObject {
  std::string name;
  ElfW(Addr) base = 0;
  const ElfW(Phdr)* phdr = nullptr;
  ElfW(Half) phnum = 0;
};

int collect_object(struct dl_phdr_info* info, size_t, void* data) {
  auto* out = static_cast<std::vector<LoadedObject>*>(data);
  out->push_back({info->dlpi_name ? info->dlpi_name : "", info->dlpi_addr, info->dlpi_phdr,
                  info->dlpi_phnum});
  return 0;
}

std::vector<LoadedObject> loaded_objects() {
  std::vector<LoadedObject> objects;
  dl_iterate_phdr(collect_object, &objects);
  return objects;
}

LoadedObject find_loaded(const std::string& path) {
  for (const auto& o : loaded_objects()) {
    if (o.name == path) return o;
  }
  throw std::runtime_error("library " + path + " is not loaded in this process");
}

struct DynamicInfo {
  const ElfW(Rela)* jmprel = nullptr;
  size_t pltrelsz = 0;
  ElfW(Sxword) pltrel = 0;
  const ElfW(Rela)* rela = nullptr;
  size_t relasz = 0;
  const ElfW(Sym)* symtab = nullptr;
  const char* strtab = nullptr;
  bool bind_now = false;
};

DynamicInfo read_dynamic(const LoadedObject& o) {
  const ElfW(Dyn)* dyn = nullptr;
  for (ElfW(Half) i = 0; i < o.phnum; ++i) {
    if (o.phdr[i].p_type == PT_DYNAMIC) {
      dyn = reinterpret_cast<const ElfW(Dyn)*>(o.base + o.phdr[i].p_vaddr);
    }
  }
  if (dyn == nullptr) throw std::runtime_error(o.name + " has no dynamic section");
  // glibc rewrites these entries to absolute addresses when it loads a library; other loaders
  // leave them as offsets from the load base. An offset is always below the base.
  auto address = [&](ElfW(Addr) p) { return p < o.base ? o.base + p : p; };
  DynamicInfo d;
  for (; dyn->d_tag != DT_NULL; ++dyn) {
    switch (dyn->d_tag) {
      case DT_JMPREL: d.jmprel = reinterpret_cast<const ElfW(Rela)*>(address(dyn->d_un.d_ptr)); break;
      case DT_PLTRELSZ: d.pltrelsz = dyn->d_un.d_val; break;
      case DT_PLTREL: d.pltrel = static_cast<ElfW(Sxword)>(dyn->d_un.d_val); break;
      case DT_RELA: d.rela = reinterpret_cast<const ElfW(Rela)*>(address(dyn->d_un.d_ptr)); break;
      case DT_RELASZ: d.relasz = dyn->d_un.d_val; break;
      case DT_SYMTAB: d.symtab = reinterpret_cast<const ElfW(Sym)*>(address(dyn->d_un.d_ptr)); break;
      case DT_STRTAB: d.strtab = reinterpret_cast<const char*>(address(dyn->d_un.d_ptr)); break;
      case DT_BIND_NOW: d.bind_now = true; break;
      case DT_FLAGS: d.bind_now |= (dyn->d_un.d_val & DF_BIND_NOW) != 0; break;
      case DT_FLAGS_1: d.bind_now |= (dyn->d_un.d_val & DF_1_NOW) != 0; break;
      default: break;
    }
  }
  if (d.symtab == nullptr || d.strtab == nullptr) {
    throw std::runtime_error(o.name + " has no dynamic symbol table");
  }
  return d;
}

struct Slot {
  uintptr_t address;
  uintptr_t value;
};

struct SlotScan {
  LoadedObject object;
  DynamicInfo dynamic;
  std::vector<Slot> slots;   // JUMP_SLOT relocations of the symbol
  size_t glob_dat = 0;       // GLOB_DAT references of the symbol (not PLT calls; left alone)
  uintptr_t definition = 0;  // where the library defines the symbol, 0 if it only imports it
};

const char* symbol_name(const DynamicInfo& d, const ElfW(Rela)& r) {
  return d.strtab + d.symtab[ELF64_R_SYM(r.r_info)].st_name;
}

SlotScan scan(const std::string& path, const std::string& symbol) {
  SlotScan s{find_loaded(path), {}, {}, 0, 0};
  s.dynamic = read_dynamic(s.object);
  const DynamicInfo& d = s.dynamic;
  if (d.jmprel != nullptr && d.pltrel != DT_RELA) {
    throw std::runtime_error(path + ": PLT relocations are not RELA; unsupported layout");
  }
  const size_t njmp = d.jmprel ? d.pltrelsz / sizeof(ElfW(Rela)) : 0;
  for (size_t i = 0; i < njmp; ++i) {
    const ElfW(Rela)& r = d.jmprel[i];
    if (ELF64_R_TYPE(r.r_info) != kJumpSlot || ELF64_R_SYM(r.r_info) == 0) continue;
    if (std::strcmp(symbol_name(d, r), symbol.c_str()) != 0) continue;
    const ElfW(Sym)& sym = d.symtab[ELF64_R_SYM(r.r_info)];
    if (sym.st_shndx != SHN_UNDEF && sym.st_value != 0) s.definition = s.object.base + sym.st_value;
    const uintptr_t where = s.object.base + r.r_offset;
    s.slots.push_back({where, *reinterpret_cast<const uintptr_t*>(where)});
  }
  const size_t nrela = d.rela ? d.relasz / sizeof(ElfW(Rela)) : 0;
  for (size_t i = 0; i < nrela; ++i) {
    const ElfW(Rela)& r = d.rela[i];
    if (ELF64_R_TYPE(r.r_info) == kGlobDat && ELF64_R_SYM(r.r_info) != 0 &&
        std::strcmp(symbol_name(d, r), symbol.c_str()) == 0) {
      ++s.glob_dat;
    }
  }
  return s;
}

// ---- writing a slot that may sit on a read-only (RELRO) page --------------------------------

// Protection of the mapping holding `address`, from /proc/self/maps; -1 when not found.
int page_protection(uintptr_t address) {
  FILE* maps = std::fopen("/proc/self/maps", "r");
  if (maps == nullptr) return -1;
  char line[4096];
  int prot = -1;
  while (std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long start = 0, end = 0;
    char perms[5] = {0};
    if (std::sscanf(line, "%lx-%lx %4s", &start, &end, perms) != 3) continue;
    if (address >= start && address < end) {
      prot = (perms[0] == 'r' ? PROT_READ : 0) | (perms[1] == 'w' ? PROT_WRITE : 0) |
             (perms[2] == 'x' ? PROT_EXEC : 0);
      break;
    }
  }
  std::fclose(maps);
  return prot;
}

// Stores `value` at `slot`; returns whether the page had to be made writable for it.
bool write_slot(uintptr_t slot, uintptr_t value) {
  const int prot = page_protection(slot);
  if (prot < 0) throw std::runtime_error("slot address is not mapped in /proc/self/maps");
  const bool read_only = (prot & PROT_WRITE) == 0;
  const long page = sysconf(_SC_PAGESIZE);
  void* page_start = reinterpret_cast<void*>(slot & ~static_cast<uintptr_t>(page - 1));
  if (read_only && mprotect(page_start, static_cast<size_t>(page), prot | PROT_WRITE) != 0) {
    throw std::runtime_error(std::string("mprotect(PROT_WRITE) on a read-only GOT page failed: ") +
                             std::strerror(errno));
  }
  __atomic_store_n(reinterpret_cast<uintptr_t*>(slot), value, __ATOMIC_SEQ_CST);
  if (read_only && mprotect(page_start, static_cast<size_t>(page), prot) != 0) {
    throw std::runtime_error(std::string("restoring a read-only GOT page failed: ") +
                             std::strerror(errno));
  }
  return read_only;
}

std::string no_slot_message(const SlotScan& s, const std::string& path, const std::string& symbol) {
  std::string msg = path + " has no " + kJumpSlotName + " relocation for " + symbol;
  if (s.glob_dat > 0) {
    msg += " (it references the symbol through " + std::to_string(s.glob_dat) +
           " GOT entr" + (s.glob_dat == 1 ? "y" : "ies") + " instead: built with -fno-plt?)";
  } else if (s.definition == 0) {
    msg += " (the library does not call it through its PLT)";
  }
  return msg;
}

// ---- what Python sees ------------------------------------------------------------------------

py::list py_loaded_libraries() {
  py::list names;
  for (const auto& o : loaded_objects()) {
    if (!o.name.empty()) names.append(o.name);
  }
  return names;
}

py::dict describe(const SlotScan& s) {
  py::dict out;
  py::list slots, values;
  for (const auto& slot : s.slots) {
    slots.append(slot.address);
    values.append(slot.value);
  }
  out["library"] = s.object.name;
  out["base"] = static_cast<uintptr_t>(s.object.base);
  out["slots"] = slots;
  out["targets"] = values;
  out["definition"] = s.definition ? py::object(py::int_(s.definition)) : py::object(py::none());
  out["glob_dat"] = s.glob_dat;
  out["binding"] = s.dynamic.bind_now ? "now" : "lazy";
  return out;
}

py::dict py_plt_slots(const std::string& path, const std::string& symbol) {
  return describe(scan(path, symbol));
}

py::dict py_plt_hook(const std::string& path, const std::string& symbol, uintptr_t target) {
  if (target == 0) throw std::invalid_argument("target address is 0");
  SlotScan s = scan(path, symbol);
  if (s.slots.empty()) throw std::runtime_error(no_slot_message(s, path, symbol));
  py::dict out = describe(s);
  py::list read_only;
  size_t rewritten = 0, already = 0;
  for (const auto& slot : s.slots) {
    if (slot.value == target) {
      ++already;
      read_only.append(false);
      continue;
    }
    read_only.append(write_slot(slot.address, target));
    ++rewritten;
  }
  out["new_target"] = target;
  out["rewritten"] = rewritten;
  out["already"] = already;
  out["read_only"] = read_only;
  return out;
}

// Every slot of every (symbol, target) pair, or none: all slots are found before the first
// store, and a store that fails puts the ones already written back. Symbols without a slot are
// reported with an empty list; when no symbol has one, nothing is written and it raises.
py::list py_plt_hook_all(const std::string& path,
                         const std::vector<std::pair<std::string, uintptr_t>>& pairs) {
  std::vector<SlotScan> scans;
  size_t found = 0;
  std::string missing;
  for (const auto& [symbol, target] : pairs) {
    if (target == 0) throw std::invalid_argument("target address for " + symbol + " is 0");
    scans.push_back(scan(path, symbol));
    found += scans.back().slots.size();
    if (scans.back().slots.empty()) missing += (missing.empty() ? "" : "; ") + no_slot_message(scans.back(), path, symbol);
  }
  if (found == 0) throw std::runtime_error(missing.empty() ? path + ": nothing to hook" : missing);
  std::vector<Slot> written;  // (slot, old value) for the undo
  std::vector<std::vector<bool>> read_only(scans.size());
  try {
    for (size_t i = 0; i < scans.size(); ++i) {
      for (const auto& slot : scans[i].slots) {
        if (slot.value == pairs[i].second) {
          read_only[i].push_back(false);
          continue;
        }
        read_only[i].push_back(write_slot(slot.address, pairs[i].second));
        written.push_back(slot);
      }
    }
  } catch (const std::exception& e) {
    for (auto it = written.rbegin(); it != written.rend(); ++it) {
      try { write_slot(it->address, it->value); } catch (const std::exception&) {}
    }
    throw std::runtime_error(std::string("rewriting the GOT failed, every slot put back: ") + e.what());
  }
  py::list out;
  for (size_t i = 0; i < scans.size(); ++i) {
    py::dict d = describe(scans[i]);
    size_t rewritten = 0, already = 0;
    for (const auto& slot : scans[i].slots) (slot.value == pairs[i].second ? already : rewritten) += 1;
    py::list ro;
    for (bool b : read_only[i]) ro.append(b);
    d["symbol"] = pairs[i].first;
    d["new_target"] = pairs[i].second;
    d["rewritten"] = rewritten;
    d["already"] = already;
    d["read_only"] = ro;
    out.append(d);
  }
  return out;
}

std::string py_bind_cuda_runtime(const std::string& path) {
  // RTLD_NOLOAD: a handle on the already loaded library, never a second copy. A handle lookup
  // searches the library and then its dependencies, i.e. the runtime the library itself uses.
  void* handle = dlopen(path.c_str(), RTLD_LAZY | RTLD_NOLOAD);
  if (handle == nullptr) throw std::runtime_error("library " + path + " is not loaded in this process");
  void* get_device = dlsym(handle, "cudaGetDevice");
  void* get_attribute = dlsym(handle, "cudaDeviceGetAttribute");
  dlclose(handle);
  if (get_device == nullptr || get_attribute == nullptr) {
    get_device = dlsym(RTLD_DEFAULT, "cudaGetDevice");
    get_attribute = dlsym(RTLD_DEFAULT, "cudaDeviceGetAttribute");
  }
  if (get_device == nullptr || get_attribute == nullptr) {
    throw std::runtime_error(
        "the CUDA runtime (cudaGetDevice, cudaDeviceGetAttribute) is not loaded: neither " + path +
        " nor the process provides it");
  }
  Dl_info info{};
  std::string provider = dladdr(get_device, &info) && info.dli_fname ? info.dli_fname : "?";
  if (g_get_device.load() != reinterpret_cast<CudaGetDevice>(get_device)) {
    for (auto& c : g_capability) c.store(0);  // answers of another runtime do not carry over
  }
  g_get_attribute.store(reinterpret_cast<CudaDeviceGetAttribute>(get_attribute), std::memory_order_release);
  g_get_device.store(reinterpret_cast<CudaGetDevice>(get_device), std::memory_order_release);
  g_runtime_path = provider;
  return provider;
}

py::object py_cuda_runtime() {
  if (g_get_device.load() == nullptr) return py::none();
  return py::str(g_runtime_path);
}

int py_sm_version_current_device() {
  if (g_get_device.load() == nullptr || g_get_attribute.load() == nullptr) {
    throw std::runtime_error("the CUDA runtime is not bound yet: call bind_cuda_runtime first");
  }
  return vllm_dualgpu_sm_version_current_device();
}

int py_device_attribute(int attr, int device) {
  if (g_get_device.load() == nullptr || g_get_attribute.load() == nullptr) {
    throw std::runtime_error("the CUDA runtime is not bound yet: call bind_cuda_runtime first");
  }
  int value = 0;
  const int rc = vllm_dualgpu_device_get_attribute(&value, attr, device);
  if (rc != 0) throw std::runtime_error("cudaDeviceGetAttribute failed with error " + std::to_string(rc));
  return value;
}

}  // namespace

void register_sm_hook(py::module_& m) {
  m.def("loaded_libraries", &py_loaded_libraries,
        "Paths of the shared objects loaded in this process (dl_iterate_phdr order).");
  m.def("plt_slots", &py_plt_slots, py::arg("library"), py::arg("symbol"),
        "Read-only: the PLT (JUMP_SLOT) GOT slots of `symbol` in the loaded `library` (exact "
        "path), their current targets, the symbol's definition and the library's binding mode.");
  m.def("plt_hook", &py_plt_hook, py::arg("library"), py::arg("symbol"), py::arg("target"),
        "Point every PLT slot of `symbol` in the loaded `library` at address `target`. Slots "
        "already there are left as they are; read-only (RELRO) pages are made writable for the "
        "store and restored. Raises when the library is not loaded or has no such slot.");
  m.def("plt_hook_all", &py_plt_hook_all, py::arg("library"), py::arg("pairs"),
        "Point every PLT slot of each (symbol, target) pair in the loaded `library` at its "
        "target: all slots or none (a failed store puts the written ones back). A symbol without "
        "a slot gets an empty entry; raises when no symbol has one. Returns one dict per pair.");
  m.def("bind_cuda_runtime", &py_bind_cuda_runtime, py::arg("library"),
        "Resolve cudaGetDevice/cudaDeviceGetAttribute through the loaded `library`'s own "
        "dependencies (else the process) for the per-device hook; returns the providing path.");
  m.def("cuda_runtime", &py_cuda_runtime, "Path of the bound CUDA runtime, or None.");
  m.def("sm_version_hook_address",
        []() { return reinterpret_cast<uintptr_t>(&vllm_dualgpu_sm_version_current_device); },
        "Address of the native per-device replacement for get_sm_version_num().");
  m.def("device_attribute_hook_address",
        []() { return reinterpret_cast<uintptr_t>(&vllm_dualgpu_device_get_attribute); },
        "Address of the native replacement for the library's cudaDeviceGetAttribute import.");
  m.def("device_attribute", &py_device_attribute, py::arg("attr"), py::arg("device"),
        "Call the cudaDeviceGetAttribute replacement once; returns the value (raises on error).");
  m.def("sm_version_current_device", &py_sm_version_current_device,
        "Call the per-device replacement once: major*10+minor of this thread's current device.");
}
