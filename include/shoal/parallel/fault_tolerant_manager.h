// FaultTolerantManager: per-step fault tolerance for data parallelism, torchft's Manager in C++.
//
// The user's loop (or FaultTolerantDdpStrategy) calls, per step:
//   manager.start_quorum();            // at the step's start: re-forms the group after a failure
//   ... forward, backward ...
//   manager.allreduce(flat_gradients); // a sum over the replicas; a failure is recorded, not thrown
//   if (manager.should_commit()) optimizer.step();  // else the step is discarded everywhere
//
// The name follows torchft's Manager (start_quorum, should_commit), so that its users are at home.
//
// Agreement. After its allreduce every replica votes: ok, or failed (its collective threw). Each
// step has one decision in the store, published by whichever replica first takes the step's
// ticket (a counter), and every replica reads that one, so all replicas commit the same steps,
// admit the same joiners, and their weights stay bit-identical; a failed step's partial sum is
// dropped by all.
//
// The common case costs a replica three or four store requests on top of the allreduce: its ok
// vote adds 1 to the step's tally (a counter); the replica whose vote brings it to the members'
// count knows every member voted ok, and publishes commit; the others wait for the decision. Any
// other case goes the slow way: a failed vote, a member whose exit the launcher reports
// (exit_key), a member whose heartbeat stood still (below), or no decision by timeout +
// quorum_grace (a hung member, or no launcher to report exits). The replica closes the tally (so a late vote cannot complete it), publishes
// its vote, and weighs the votes: commit when all members voted ok; otherwise the step fails,
// and the next generation's members are the replicas that voted. It waits for each member's vote
// until the member votes, exits or stops beating, or the time above has passed, then publishes
// its verdict unless another replica's came first. The ticket comes after the weighing, so a replica killed
// while it waits for the votes (the long part) holds up no one.
//
// Heartbeat. Each manager's thread adds 1 to "ft/beat/<job rank>" every comm::beat_interval();
// a member whose counter has not moved for SHOAL_HEARTBEAT_TIMEOUT (10 s by default) while a
// replica waits for its vote is taken to be stopped (SIGSTOP, a debugger) or cut off, and is not
// waited for: a live replica whose training thread is slow keeps beating and is waited for. A
// stopped member continued later finds itself left out (start_quorum throws PeerError).
//
// A survivor's collective fails at once when it waits on the dead rank, and at the time-out at
// the latest when it waits on a survivor that failed first (c10d's gloo keeps a failed group's
// connections open), so a failure costs from milliseconds to the collective time-out.
//
// Re-forming. start_quorum() after a failed step builds generation g+1's process group (a new
// store prefix, "ft/g<g+1>/pg", the same backend) over the surviving members, ranked in their
// order of job rank. A replica left out (it voted late: stopped, or slow beyond the grace) throws
// PeerError; fewer than min_replicas members throw InvalidArgument naming --min-replicas.
//
// Growing. A replacement (the launcher restarted job rank r after its exit: `shoal run
// --max-restarts`) finds its rank's exit count (exit_key) above zero when it starts, asks to join
// ("ft/join/<r>" = that count, its incarnation; "ft/joins_waiting" counts the waiting) and waits.
// The decision of a training step (should_commit(/*admit=*/true)) names the joiners waiting
// (those counted before the publisher looked; one that has exited since it asked is passed over),
// so every member admits the same joiners at the same step, and the next
// start_quorum(/*admit=*/true) forms generation g+1 over the members and the joiners and tells
// each joiner the generation ("ft/formed/<r>/<incarnation>"). The caller then copies its state to
// them from donor_replica_rank() over the new group (FaultTolerantDdpStrategy: weights, buffers,
// optimizer state, RNG and the position in the epoch). The group is authenticated as every store
// connection is, by the job's token (SHOAL_AUTH_TOKEN): a process without it cannot ask to join.
// A member's exit is counted per incarnation, so a replacement's predecessor's exit does not
// count against it. A replacement that finds the job finished ("ft/finished", set by a member
// that ends normally) throws PeerError.
//
// Elastic membership. Under `shoal run --nnodes MIN:MAX` the job's world_size is MAX nodes' ranks;
// generation 0 forms over the ranks of the nodes that started the job (founders_key()), and the
// ranks of a node that comes later find their exit count raised by its launcher and join as
// replacements do, so the world grows; a node that leaves is a failure of its ranks.
//
// What is not covered: the store itself must outlive the workers (see the GUIDE, "When ranks
// fail"); a joiner (or a member) that dies while the grown generation's group forms, or the
// donor dying while it sends the state, makes the others throw (at the group's time-out at the
// latest); a member whose manager is destroyed after its exception was caught (left out after a
// stop) tells a waiting replacement that the job finished; a replica that dies between taking the
// ticket and writing the decision (microseconds) makes the others time out with a TimeoutError
// naming the step; a replacement's manager asks to join when it is built, before its process
// loads the data, and the members wait for its state transfer up to the collective time-out.
//
// Thread safety: one thread per replica drives an instance; every member calls start_quorum,
// allreduce and should_commit the same number of times in the same order. The heartbeat runs on a
// thread of its own, which shares only the store (thread-safe).
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "shoal/comm/types.h"

namespace shoal::comm {
class ProcessGroup;
class Store;
}  // namespace shoal::comm

namespace shoal::parallel {

struct FaultTolerantOptions {
  /// The job ends (InvalidArgument) when fewer replicas than this are left.
  int min_replicas = 1;
  /// The process groups' backend (comm::new_process_group).
  std::string backend = "gloo";
  /// Each generation's collective time-out: how long a stopped peer holds a step up.
  comm::Milliseconds timeout{30'000};
  /// How long a replica waits for a missing vote beyond the collective time-out (a member
  /// whose exit the launcher reported is not waited for). A live replica votes within
  /// milliseconds of its collective's end, which the time-out bounds; 10 s leaves room for a
  /// loaded machine's scheduling, since a live replica left out must leave the job.
  comm::Milliseconds quorum_grace{10'000};
  /// How long a replacement waits to be admitted: the members admit it at their next training
  /// step's end, which a slow step or an evaluation may hold up for minutes.
  comm::Milliseconds join_timeout{600'000};
};

class FaultTolerantManager {
 public:
  /// `store` is shared by every replica of the job and outlives them (the launcher's, or rank
  /// 0's); `rank` and `world_size` are the job's. Forms generation 0's group (a collective), or,
  /// for a replacement (see the file comment), waits to be admitted and joins the current
  /// generation's successor; then joined_replicas() names this rank.
  FaultTolerantManager(std::shared_ptr<comm::Store> store, int rank, int world_size,
                       FaultTolerantOptions options = {});
  /// Ending normally (no exception in flight) tells a replacement still waiting that the job
  /// finished.
  ~FaultTolerantManager();
  FaultTolerantManager(const FaultTolerantManager&) = delete;
  FaultTolerantManager& operator=(const FaultTolerantManager&) = delete;

  /// At a step's start: after a failed step, joins the next generation's group; with `admit`,
  /// also after a step that admitted joiners (see the file comment); otherwise returns at once.
  /// A reduction that is not a training step passes admit = false: joiners then wait for the
  /// next step, so they enter every member's loop at the same place.
  void start_quorum(bool admit = true);
  /// Sums `tensor` over the members in place. A failing collective is recorded for
  /// should_commit(), not thrown; `tensor` is then undefined in content.
  void allreduce(at::Tensor& tensor);
  /// Whether every member's allreduce of this step succeeded (the same answer on every member).
  /// With `admit`, the verdict also admits the replacements that asked to join.
  bool should_commit(bool admit = true);

  /// The store key a launcher adds 1 to each time job rank `rank` exits, so that the others stop
  /// waiting for its vote (and a restarted rank knows it is a replacement).
  static std::string exit_key(int rank);
  /// The store key that names the job ranks that start the job when not all of them do
  /// (`shoal run --nnodes MIN:MAX`, launcher/elastic_rendezvous.h): generation 0 forms over
  /// those, and the others join later as replacements. Without it, every rank starts the job.
  static std::string founders_key();
  /// The store key job rank `rank`'s heartbeat thread adds 1 to every beat while it runs.
  static std::string heartbeat_key(int rank);

  /// The job ranks that joined at the latest re-forming (start_quorum or, for a replacement, the
  /// constructor), ascending; empty when none did. The members then send them their state.
  const std::vector<int>& joined_replicas() const { return joined_; }
  /// The replica rank that sends the joiners their state: the first member that was there before.
  int donor_replica_rank() const;
  /// Whether this process joined a running job as a replacement.
  bool replacement() const { return incarnation_ > 0; }

  /// The current generation's group (its rank is replica_rank()); null from a failed allreduce
  /// to the next start_quorum().
  std::shared_ptr<comm::ProcessGroup> group() const { return group_; }
  int replica_rank() const;
  int num_replicas() const { return static_cast<int>(members_.size()); }
  /// The members' job ranks, ascending.
  const std::vector<int>& members() const { return members_; }
  int job_rank() const { return rank_; }
  /// 0 at the start; one more per re-forming.
  int64_t generation() const { return generation_; }
  /// should_commit() calls so far in this generation: (generation, attempt) names a step attempt
  /// alike on every member.
  int64_t attempt() const { return attempt_; }
  const FaultTolerantOptions& options() const { return options_; }
  /// Steps that failed and were discarded so far.
  int64_t failed_steps() const { return failed_steps_; }

 private:
  std::string step_key(const std::string& what) const;
  std::string decide(bool all_ok, bool admit);
  std::string with_joiners(const std::string& verdict, bool admit);
  std::optional<std::string> tally_ok_vote(bool admit);
  bool await_decision() const;
  std::string decide_slowly(bool ok, bool admit);
  std::string publish_or_read(const std::string& verdict);
  bool apply(const std::string& decision);
  bool exited(int rank) const;
  std::string joiners_text() const;
  std::string wire_list(const std::vector<int>& ranks) const;
  void join();
  std::vector<int> founders() const;
  void re_form(std::vector<int> members);
  int64_t incarnation_of(int rank) const;
  bool await_votes(const std::vector<std::string>& votes) const;
  void form_group();
  void beat();
  void stop_beating();

  std::shared_ptr<comm::Store> store_;
  int rank_;
  FaultTolerantOptions options_;
  std::vector<int> members_;
  int world_size_;
  int64_t incarnation_ = 0;  // this process's: its rank's exits before it started
  std::map<int, int64_t> incarnations_;  // of the members that are replacements
  std::vector<int> next_members_;  // set by a failed step; start_quorum() forms them
  std::vector<int> pending_joiners_;  // admitted by a step; start_quorum(true) adds them
  std::vector<int> joined_;
  int donor_ = 0;  // job rank that sends the joiners the state
  std::shared_ptr<comm::ProcessGroup> group_;
  int64_t generation_ = 0;
  int64_t attempt_ = 0;  // should_commit() calls in this generation
  bool step_ok_ = true;
  int64_t failed_steps_ = 0;
  int64_t joins_counted_ = 0;  // the waiting joins this step's verdict looked for
  std::mutex beat_mutex_;  // with beat_stop_: tells the heartbeat thread to end
  std::condition_variable beat_stop_;
  bool beating_ = true;
  std::thread heartbeat_;  // last: started once the members above are set
};

}  // namespace shoal::parallel
