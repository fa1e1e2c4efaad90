#include "transport/transport.h"

#include "common/error.h"
#include "transport/op.h"

namespace spade::transport {

const char* status_name(Status s) {
  switch (s) {
    case Status::PENDING:
      return "PENDING";
    case Status::OK:
      return "OK";
    case Status::TIMEOUT:
      return "TIMEOUT";
    case Status::FAILED:
      return "FAILED";
    case Status::CANCELLED:
      return "CANCELLED";
  }
  return "?";
}

void check_user_tag(uint64_t tag, const std::string& what) {
  SPADE_CHECK(tag <= kMaxTag, "{}: tag {:#x} does not fit in 48 bits", what, tag);
  SPADE_CHECK((tag >> 40) != 0xFF, "{}: tag {:#x} uses the reserved kind 0xFF", what, tag);
}

namespace {
const detail::Op& checked(const std::shared_ptr<detail::Op>& op) {
  SPADE_CHECK(op != nullptr, "transport: use of an invalid (default-constructed) operation handle");
  return *op;
}
}  // namespace

Status OpHandle::poll() const {
  return checked(op_).poll();
}
Status OpHandle::wait(Deadline deadline) const {
  return checked(op_).wait(deadline);
}
size_t OpHandle::length() const {
  return checked(op_).length();
}
std::string OpHandle::error() const {
  return checked(op_).error();
}
uint64_t OpHandle::tag() const {
  return checked(op_).tag;
}

void OpHandle::cancel() const {
  checked(op_);
  if (op_->poll() != Status::PENDING) return;
  if (auto owner = op_->owner.lock()) {
    owner->cancel_op(op_);
  } else {
    op_->complete(Status::CANCELLED, 0, "cancelled (endpoint already closed)");
  }
}

}  // namespace spade::transport
