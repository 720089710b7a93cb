// Asynchronous checkpoints (checkpoint.async, as torchtitan's async_mode): at a step boundary each
// rank copies its state into host staging buffers (page-locked when the model is on the GPU, so
// the copy runs at the link's rate), and a writer thread checks it is finite, checksums and writes
// it while training goes on. Rank 0's writer publishes the checkpoint (`latest`, then
// checkpoint.keep's pruning) once every rank's file of this save is on disk; ranks share the
// directory, so it waits for their files, not for a collective (a collective from a second thread
// would race the training's). A save waits for the previous one; a crash mid-write leaves
// `latest` on the last complete checkpoint. A failed write (a full disk, a non-finite state) is
// held and reported at the next step's first collective, where every rank learns of it.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include "core/error.h"
#include "train/checkpoint.h"

namespace mt {

struct AsyncSaveTimes {
  double copy_s = 0;     // the training thread's stall: staging prepared, then the copy into it
  double prepare_s = 0;  // of it, allocating and page-locking staging (a first save, or new shapes)
  double write_s = 0;  // the writer's: check, checksum, write (and publish on rank 0)
  int64_t bytes = 0;   // this rank's file
};

class AsyncCheckpointWriter {
 public:
  // attempt: a number every rank of this process group shares and no earlier attempt of the run
  // had (a resumed run may write a step again: rank 0 must not take the old files for the new).
  AsyncCheckpointWriter(dist::Communicator* world, int64_t keep, int64_t attempt);
  ~AsyncCheckpointWriter();  // waits for the write in flight (its error is dropped)
  AsyncCheckpointWriter(const AsyncCheckpointWriter&) = delete;
  AsyncCheckpointWriter& operator=(const AsyncCheckpointWriter&) = delete;

  // Waits for the previous save (throwing its error), copies the state into staging and hands it
  // to the writer. Not collective. Returns the path the checkpoint will have.
  std::string save(const std::string& dir, Qwen3Moe& model, AdamW& opt, const TrainState& st);
  // Waits for the save in flight; throws its error (IoError, NumericalError) if it failed.
  void wait();
  // Whether the last save failed (read without waiting: the step's agreement reads it).
  bool failed() const;
  // The last finished save's times (after wait()).
  AsyncSaveTimes last_times() const;

 private:
  void run();  // the writer thread
  void write(const CheckpointTarget& target, const TrainState& st, int64_t ep);

  dist::Communicator* world_;
  int64_t keep_;
  int64_t attempt_;
  std::map<std::string, Tensor> staging_;  // name -> host copy, reused save after save
  mutable std::mutex mu_;
  std::condition_variable cv_;
  struct Job {
    CheckpointTarget target;
    TrainState state;
    int64_t ep = 1;
  };
  std::optional<Job> job_;  // handed to the writer
  bool busy_ = false;       // a job is being written
  bool quit_ = false;
  std::string error_;  // the last save's failure ("" when none)
  ExitCode error_code_ = ExitCode::kIo;
  AsyncSaveTimes times_;
  std::thread thread_;
};

}  // namespace mt
