#include "model/nano_generator.h"

#include "model/bpe_trainer.h"

namespace epd::model {

absl::StatusOr<std::string> NanoTokenizerJson() {
  BpeTrainerOptions o;
  o.leading_specials = {"<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"};
  o.trailing_added = {{"<｜User｜>", true},        {"<｜Assistant｜>", true},
                      {"<think>", false},           {"</think>", false},
                      {"｜DSML｜", false},          {"<｜System｜>", false},
                      {"<｜latest_reminder｜>", true}, {"<｜deepseek_image｜>", true}};
  o.vocab_size = 2048;
  return TrainByteLevelBpe(NanoCorpus(), o);
}

}  // namespace epd::model
