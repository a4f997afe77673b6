// SLURM's hostlist syntax, expanded: what `scontrol show hostnames` prints.
//
// SLURM names a job's nodes compactly in SLURM_JOB_NODELIST / SLURM_STEP_NODELIST:
// "gpu[01-04,07],login1" is gpu01 gpu02 gpu03 gpu04 gpu07 login1. A list is names separated by
// commas (or spaces) outside brackets; a bracket holds numbers and ranges "a-b" separated by commas,
// each written as wide as its first number ("08-10" is 08 09 10, "9-11" is 9 10 11); several bracket
// groups in one name multiply ("rack[1-2]-n[1-2]": rack1-n1 rack1-n2 rack2-n1 rack2-n2, the first
// group the slowest). Duplicates are kept, in order, as scontrol keeps them.
//
// Thread safety: free functions without state.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace shoal::comm {

/// The host names of a SLURM hostlist, in order, the first `max_hosts` of them (the whole list is
/// checked and counted all the same, without being written out). Throws InvalidArgument naming
/// `what` (the variable it came from, e.g. "SLURM_STEP_NODELIST") for a list SLURM would not
/// accept: an unbalanced or empty bracket, a reversed range ("[5-3]"), a non-number in a bracket,
/// or text after the last bracket of a name ("n[1-2]x"); and for one naming more than 2^20 hosts
/// in all, more than any job has.
std::vector<std::string> expand_slurm_hostlist(const std::string& hostlist,
                                               const std::string& what = "hostlist",
                                               size_t max_hosts = SIZE_MAX);

}  // namespace shoal::comm
