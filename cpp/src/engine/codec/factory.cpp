// The one factory of codecs, and the one table of which coding runs on which
// device. The Python layer asks this table (through the binding) rather than
// keeping a list of its own.
#include <string>

#include "engine/codec/codings.h"
#include "hemiola/status.h"

namespace hemiola {

const std::vector<Coding>& codings() {
  // The CUDA path casts to fp16/bf16 on the engine's stream; int8, PowerSGD
  // and int4 are written for host memory only. Streaming sends a fragment
  // per sync and no low-rank warm-up fits that: PowerSGD does not stream.
  static const std::vector<Coding> table = {
      //  compression            name       host  cuda   streams residuals
      {Compression::kNone, "none", true, true, true, false},
      {Compression::kFp16, "fp16", true, true, true, false},
      {Compression::kBf16, "bf16", true, true, true, false},
      {Compression::kInt8, "int8", true, false, true, true},
      {Compression::kPowerSgd, "powersgd", true, false, false, true},
      {Compression::kInt4, "int4", true, false, true, true},
  };
  return table;
}

const Coding& coding(Compression compression) {
  for (const Coding& c : codings()) {
    if (c.compression == compression) return c;
  }
  HEMIOLA_THROW(ErrorCode::kInvalidArgument, "unknown compression code ",
                static_cast<int>(compression));
}

namespace {

bool runs_on(const Coding& coding, bool cuda) { return cuda ? coding.cuda : coding.host; }

// What a reducer on that kind of device compresses with, and what it does
// not: "a CUDA reducer compresses with fp16 or bf16; int8 and powersgd are
// implemented for CPU reducers only".
std::string refusal(bool cuda) {
  const auto compresses = [](const Coding& c) { return c.compression != Compression::kNone; };
  const std::vector<const char*> here =
      coding_names([&](const Coding& c) { return compresses(c) && runs_on(c, cuda); });
  const std::vector<const char*> elsewhere =
      coding_names([&](const Coding& c) { return compresses(c) && !runs_on(c, cuda); });
  return std::string("a ") + (cuda ? "CUDA" : "CPU") + " reducer compresses with " +
         listed(here, "or") + "; " + listed(elsewhere, "and") +
         (elsewhere.size() == 1 ? " is" : " are") + " implemented for " +
         (cuda ? "CPU" : "CUDA") + " reducers only";
}

}  // namespace

std::unique_ptr<Codec> make_codec(const CodecSpec& spec) {
  HEMIOLA_CHECK(spec.world_size >= 1, "world size must be positive, got ", spec.world_size);
  const bool cuda = spec.device.type == DeviceType::kCUDA;
  HEMIOLA_CHECK(runs_on(coding(spec.compression), cuda), refusal(cuda));
  if (spec.compression == Compression::kNone) return make_none_codec(spec);
  HEMIOLA_CHECK(spec.average, "ReducerOptions::compression averages on the wire (each rank "
                "divides by the world size before its coding): it needs average = true");
  switch (spec.compression) {
    case Compression::kFp16:
    case Compression::kBf16:
      return make_half_codec(spec);
    case Compression::kInt8:
      return make_int8_codec(spec);
    case Compression::kPowerSgd:
      return make_powersgd_codec(spec);
    case Compression::kInt4:
      return make_int4_codec(spec);
    case Compression::kNone:
      break;
  }
  return make_none_codec(spec);
}

}  // namespace hemiola
