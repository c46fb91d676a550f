// save_checkpoint of any subject ([Note: checkpoint subjects] in checkpoint_subject.h): the
// plan ([Note: save plans]) written on the calling thread and published at once; the
// asynchronous save (async_save.h) writes the same plan's snapshot on a thread of its own.
#include "fsdp/state/checkpoint.h"

#include "async_save.h"
#include "checkpoint_span.h"
#include "checkpoint_subject.h"
#include "checkpoint_writer.h"
#include "fsdp/comm/call_label.h"
#include "save_plan.h"
#include "store_agreement.h"

namespace fsdp {

void state::save_checkpoint_of(const std::string& dir, const CheckpointSubject& subject,
                               const torch::optim::Optimizer* optimizer, const CheckpointExtra& extra) {
  comm::LabelScope label_scope({comm::Phase::kCheckpoint, "save"});
  detail::settle_in_flight();
  StoreAgreement agree(subject.group, "save_checkpoint");
  CheckpointSpan span(subject.tracer, "checkpoint write " + dir, Tracer::kCheckpoint);
  write_checkpoint(plan_save(dir, subject, optimizer, extra), agree, Publication::kNow);
}

}  // namespace fsdp
