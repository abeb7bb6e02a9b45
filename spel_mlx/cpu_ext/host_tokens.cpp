// Token ids a pass is built on before they are known: a graph node whose values the
// host sets before the pass is evaluated.  Sampled AR builds each step's pass while the
// one before runs and sets its token once it has sampled it (greedy AR builds on the
// lazy argmax instead); the Python and graph-building part of a step then no longer adds
// to it (docs/decoding.md, "Sampled AR looks ahead").
#include <memory>
#include <stdexcept>
#include <string>

#include "common.h"
#include "ops.h"

namespace spel {

struct HostTokens::Slot {
  std::vector<int32_t> ids;
  bool set = false;
};

namespace {

class SpelHostTokens : public CpuPrimitive {
 public:
  SpelHostTokens(mx::Stream s, std::shared_ptr<HostTokens::Slot> slot)
      : CpuPrimitive(s, P_ROWWISE), slot_(std::move(slot)) {}
  const char* name() const override { return "SpelHostTokens"; }

 protected:
  // called on the host as the graph is evaluated: the ids must be set by then
  Task task() const override {
    if (!slot_->set) throw std::runtime_error("HostTokens: evaluated before its token ids were set");
    return [ids = slot_->ids](const std::vector<mx::array>&, std::vector<mx::array>& out) {
      int32_t* o = out[0].data<int32_t>();
      for (size_t i = 0; i < ids.size(); i++) o[i] = ids[i];
    };
  }

 private:
  std::shared_ptr<HostTokens::Slot> slot_;
};

}  // namespace

HostTokens::HostTokens(int n) : slot_(std::make_shared<Slot>()), array_(mx::array(0)) {
  if (n < 1) throw std::invalid_argument("HostTokens: n must be at least 1");
  slot_->ids.assign(n, 0);
  array_ = mx::array({n}, mx::int32, std::make_shared<SpelHostTokens>(cpu_stream(), slot_), {});
}

void HostTokens::set(const std::vector<int32_t>& ids) {
  if (slot_->set) throw std::invalid_argument("HostTokens.set: the token ids are set already");
  if (ids.size() != slot_->ids.size())
    throw std::invalid_argument("HostTokens.set: expected " + std::to_string(slot_->ids.size()) + " ids, not " +
                                std::to_string(ids.size()));
  slot_->ids = ids;
  slot_->set = true;
}

}  // namespace spel
