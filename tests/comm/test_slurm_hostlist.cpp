// SLURM hostlist expansion (comm/slurm_hostlist.h): cases written out by hand, the lists SLURM
// and Shoal refuse, and every accepted case compared with `scontrol show hostnames` when SLURM is installed.
#include <gtest/gtest.h>

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "comm/slurm_hostlist.h"
#include "shoal/error.h"
#include "testing/child_process.h"
#include "testing/dependencies.h"

namespace shoal::comm {
namespace test_slurm_hostlist {

using Hosts = std::vector<std::string>;

struct Case {
  const char* hostlist;
  Hosts hosts;
};

// Each case as scontrol show hostnames prints it (checked below where scontrol is installed).
const Case kCases[] = {
    {"login1", {"login1"}},
    {"gpu[01-04,07],login1", {"gpu01", "gpu02", "gpu03", "gpu04", "gpu07", "login1"}},
    {"n[1-3]", {"n1", "n2", "n3"}},
    {"n[9-11]", {"n9", "n10", "n11"}},               // width of the first number: no padding
    {"n[08-10]", {"n08", "n09", "n10"}},             // leading zeros kept past a carry
    {"n[001-3]", {"n001", "n002", "n003"}},          // the first number's width for the range
    {"n[098-101]", {"n098", "n099", "n100", "n101"}},
    {"n[0-0]", {"n0"}},
    {"n[1,3,5-6]", {"n1", "n3", "n5", "n6"}},        // several ranges in one bracket
    {"rack[1-2]-node[01-02]", {"rack1-node01", "rack1-node02", "rack2-node01", "rack2-node02"}},
    {"n[1-2]-[3-4]", {"n1-3", "n1-4", "n2-3", "n2-4"}},  // two bracket groups, the first slowest
    {"a[1-2],b[3]", {"a1", "a2", "b3"}},              // several bracket names
    {"a,b,c", {"a", "b", "c"}},
    {"a,a", {"a", "a"}},                              // duplicates kept
    {"n[1,1]", {"n1", "n1"}},
    {"n[1-3],n2", {"n1", "n2", "n3", "n2"}},
    {"n1-2", {"n1-2"}},                               // a dash outside brackets is a name
    {"a b", {"a", "b"}},                              // spaces separate too
    {"n[1-2],,m", {"n1", "n2", "m"}},                 // empty names are skipped
    {"node-a.example.org,node[7-8].example", {}},     // filled in below: dots are plain text
    {"", {}},
};

TEST(SlurmHostlist, ExpandsAsScontrolDoes) {
  for (const Case& c : kCases) {
    if (std::string(c.hostlist).find("example") != std::string::npos) continue;
    EXPECT_EQ(expand_slurm_hostlist(c.hostlist), c.hosts) << c.hostlist;
  }
  // "node[7-8].example" has text after its bracket: SLURM refuses that, and so does Shoal.
  EXPECT_THROW(expand_slurm_hostlist("node-a.example.org,node[7-8].example"), InvalidArgument);
  EXPECT_EQ(expand_slurm_hostlist("node-a.example.org,ib-node[7-8]"),
            (Hosts{"node-a.example.org", "ib-node7", "ib-node8"}));
}

// SLURM refuses most of these; a few ("n1-2]", "n[1-]", "n[1-2][") it passes on garbled. Shoal
// refuses them all rather than rendezvous on a host that does not exist.
TEST(SlurmHostlist, RefusesMalformedLists) {
  for (const char* bad : {"n[3-1]", "x[]", "n[1-2", "n1-2]", "n[1-2]x", "n[a-b]", "n[1-]",
                          "n[[1]]", "n[1-2][", "n[-3]"}) {
    try {
      expand_slurm_hostlist(bad, "SLURM_JOB_NODELIST");
      ADD_FAILURE() << "'" << bad << "' was accepted";
    } catch (const InvalidArgument& e) {
      // Names the variable and the list, and says what a hostlist looks like.
      const std::string message = e.what();
      EXPECT_NE(message.find("SLURM_JOB_NODELIST='" + std::string(bad) + "'"), std::string::npos)
          << message;
      EXPECT_NE(message.find("gpu[01-04,07]"), std::string::npos) << message;
    }
  }
  // A bracket too large to be a real job fails instead of filling memory.
  EXPECT_THROW(expand_slurm_hostlist("n[0-999999999]"), InvalidArgument);
}

// 10 KB of "n[0-1048574]" names 10^9 hosts: counted and refused before any is written out, and
// a caller asking for the first host of a long list gets it without the rest.
TEST(SlurmHostlist, AHugeListIsCountedNotWrittenOut) {
  std::string brackets;
  while (brackets.size() < 10'000) brackets += (brackets.empty() ? "" : ",") + std::string("n[0-1048574]");
  const auto refused = shoal::testing::run_in_child([&]() -> std::string {
    try {
      return "expanded to " + std::to_string(expand_slurm_hostlist(brackets, "SLURM_STEP_NODELIST").size());
    } catch (const InvalidArgument& e) {
      return e.what();
    }
  });
  ASSERT_TRUE(refused.exited) << "signal " << refused.signal;
  EXPECT_NE(refused.message.find("SLURM_STEP_NODELIST names more than 1048576 hosts"), std::string::npos)
      << refused.message;
  EXPECT_LT(refused.message.size(), 300u);
  EXPECT_LT(refused.peak_growth_kb, 16 * 1024) << refused.message;
  EXPECT_LT(refused.seconds, 5.0) << refused.message;

  const auto first = shoal::testing::run_in_child([]() -> std::string {
    const auto hosts = expand_slurm_hostlist("n[0-1048574],m", "SLURM_STEP_NODELIST", 1);
    return hosts.size() == 1 ? hosts[0] : std::to_string(hosts.size()) + " hosts";
  });
  EXPECT_EQ(first.message, "n0");
  EXPECT_LT(first.peak_growth_kb, 16 * 1024);
  // The limit stops the writing, not the checking.
  EXPECT_THROW(expand_slurm_hostlist("n[0-1],m[3-1]", "X", 1), InvalidArgument);
  EXPECT_EQ(expand_slurm_hostlist("a[1-2]-[1-2],b", "X", 3), (Hosts{"a1-1", "a1-2", "a2-1"}));
}

// scontrol's expansion of `hostlist`, one host a line, with a throw-away configuration (scontrol
// reads one, but `show hostnames` asks no daemon).
Hosts scontrol_hostnames(const std::string& conf, const std::string& hostlist) {
  const std::string command = "SLURM_CONF='" + conf + "' timeout 20 scontrol show hostnames '" +
                              hostlist + "' 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return {"<popen failed>"};
  Hosts hosts;
  char line[4096];
  while (std::fgets(line, sizeof(line), pipe) != nullptr) {
    std::string host(line);
    while (!host.empty() && (host.back() == '\n' || host.back() == '\r')) host.pop_back();
    hosts.push_back(host);
  }
  pclose(pipe);
  return hosts;
}

TEST(SlurmHostlist, EqualsScontrolShowHostnames) {
  const bool have = std::system("command -v scontrol >/dev/null 2>&1") == 0;
  SHOAL_SKIP_UNLESS(have, testing::Dependency::kSlurm,
                    "scontrol is not installed (scripts/setup.sh installs slurm-wlm)");
  const auto dir = std::filesystem::temp_directory_path() /
                   ("shoal-hostlist-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string conf = (dir / "slurm.conf").string();
  std::ofstream(conf) << "ClusterName=hostlisttest\nSlurmctldHost=localhost\n"
                         "NodeName=localhost\n";
  int compared = 0;
  for (const Case& c : kCases) {
    const std::string list = c.hostlist;
    if (list.empty() || list.find("example") != std::string::npos) continue;
    EXPECT_EQ(expand_slurm_hostlist(list), scontrol_hostnames(conf, list)) << list;
    ++compared;
  }
  const std::string dotted = "node-a.example.org,ib-node[7-8]";
  EXPECT_EQ(expand_slurm_hostlist(dotted), scontrol_hostnames(conf, dotted));
  EXPECT_GE(compared + 1, 15);
  std::filesystem::remove_all(dir);
}

}  // namespace test_slurm_hostlist
}  // namespace shoal::comm
