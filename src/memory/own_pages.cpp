// See [Note: state on pages of its own] in own_pages.h.
#include "own_pages.h"

#include <cstring>
#include <memory>

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include "page_mapping.h"

namespace fsdp::memory {

namespace {

void delete_own_pages(void* ctx) { delete static_cast<PageMapping*>(ctx); }

bool is_own_pages(const c10::DataPtr& p) { return p.get_deleter() == &delete_own_pages; }

// A storage the CPU allocator made (not pinned, not shared, not a pool's).
bool is_plain_cpu(const c10::DataPtr& p) {
  return p.device().is_cpu() && p.get_deleter() == c10::GetCPUAllocator()->raw_deleter();
}

}  // namespace

bool move_to_own_pages(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return false;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  const c10::DataPtr& old = impl->data_ptr();
  if (is_own_pages(old)) return true;
  if (!is_plain_cpu(old) || old.get() == nullptr) return false;
  const size_t nbytes = impl->nbytes();
  auto pages = std::make_unique<PageMapping>(nbytes);
  std::memcpy(pages->data(), old.get(), nbytes);
  void* data = pages->data();
  impl->set_data_ptr_noswap(c10::DataPtr(data, pages.release(), &delete_own_pages, c10::Device(c10::kCPU)));
  return true;
}

CowRegion own_pages_of(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage()) return {};
  const c10::DataPtr& p = t.storage().unsafeGetStorageImpl()->data_ptr();
  if (!is_own_pages(p)) return {};
  const auto* pages = static_cast<const PageMapping*>(p.get_context());
  return {pages->data(), pages->bytes()};
}

}  // namespace fsdp::memory
