// hier_traffic: the bytes each collective sends over TCP when the ranks pretend to be on several
// hosts (SHOAL_HOSTNAME), hierarchical backend against flat gloo, measured side by side (rounds
// of A B A B, medians).
//
//   hier_traffic [--hosts a,a,b,b] [--bytes 1048576] [--iters 4] [--rounds 5] [--json]
//
// A measuring tool, not a test. It reads the bytes sent on every TCP socket of the ranks
// (`ss -tie`, bytes_sent) before and after each reading, and splits them into those between
// pretended hosts (what a real network would carry) and all of them; shm traffic inside a host
// does not show. Rank 0 prints.
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "shoal/comm/init.h"
#include "shoal/error.h"
#include "testing/multi_rank.h"

namespace {

using shoal::comm::Milliseconds;
using shoal::comm::ProcessGroup;
using shoal::comm::ReduceOp;

struct Settings {
  std::string hosts = "a,a,b,b";
  int64_t bytes = 1 << 20;
  int iters = 4;
  int rounds = 5;
  bool json = false;
};

// TCP payload bytes sent so far by the ranks' sockets: in all, and between pretended hosts.
struct TcpBytes {
  double all = 0;
  double between_hosts = 0;
};

// The inodes of this process's sockets, "12,34", from /proc/self/fd.
std::string my_socket_inodes() {
  std::string out;
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator("/proc/self/fd", ec)) {
    const std::string target = std::filesystem::read_symlink(entry.path(), ec).string();
    if (target.rfind("socket:[", 0) == 0) {
      out += (out.empty() ? "" : ",") + target.substr(8, target.size() - 9);
    }
  }
  return out;
}

// Reads `ss -tieH`: per socket a line "state recv-q send-q local peer ino:N ...", then an
// indented line of TCP info holding "bytes_sent:N". `host_of_inode` names the ranks' sockets.
TcpBytes tcp_bytes(const std::map<std::string, std::string>& host_of_inode) {
  FILE* pipe = popen("ss -tieH 2>/dev/null", "r");
  SHOAL_CHECK(pipe != nullptr, "hier_traffic: cannot run ss (iproute2)");
  struct Socket {
    std::string local, peer, inode;
    double sent = 0;
  };
  std::vector<Socket> sockets;
  char buffer[8192];
  while (std::fgets(buffer, sizeof buffer, pipe) != nullptr) {
    const std::string line = buffer;
    if (line.empty()) continue;
    if (line[0] != ' ' && line[0] != '\t') {
      std::istringstream fields(line);
      std::string state, recv_q, send_q;
      Socket socket;
      fields >> state >> recv_q >> send_q >> socket.local >> socket.peer;
      const auto at = line.find(" ino:");
      if (at != std::string::npos) {
        socket.inode = line.substr(at + 5, line.find_first_not_of("0123456789", at + 5) - at - 5);
      }
      sockets.push_back(socket);
    } else if (!sockets.empty()) {
      const auto at = line.find("bytes_sent:");
      if (at != std::string::npos) sockets.back().sent = std::atof(line.c_str() + at + 11);
    }
  }
  pclose(pipe);
  std::map<std::string, std::string> inode_of_endpoint;
  for (const auto& socket : sockets) inode_of_endpoint[socket.local] = socket.inode;
  TcpBytes out;
  for (const auto& socket : sockets) {
    auto mine = host_of_inode.find(socket.inode);
    auto peer_inode = inode_of_endpoint.find(socket.peer);
    if (mine == host_of_inode.end() || peer_inode == inode_of_endpoint.end()) continue;
    auto peer = host_of_inode.find(peer_inode->second);
    if (peer == host_of_inode.end()) continue;
    out.all += socket.sent;
    if (mine->second != peer->second) out.between_hosts += socket.sent;
  }
  return out;
}

// One collective as every rank issues it; the root of rooted ones is the last rank, which is on
// another host than the first host's leader in the usual layouts.
void run_collective(ProcessGroup& pg, const std::string& name, int64_t numel) {
  const int n = pg.size();
  const int root = n - 1;
  auto t = torch::ones({numel});
  std::vector<at::Tensor> list;
  const bool needs_list = name == "allgather" || name == "reduce_scatter" ||
                          (pg.rank() == root && (name == "gather" || name == "scatter"));
  if (needs_list) {
    for (int r = 0; r < n; ++r) list.push_back(torch::ones({numel}));
  }
  if (name == "allreduce") pg.allreduce(t)->wait();
  if (name == "broadcast") pg.broadcast(t, {root})->wait();
  if (name == "reduce") pg.reduce(t, {root, ReduceOp::kSum})->wait();
  if (name == "allgather") pg.allgather(list, t)->wait();
  if (name == "gather") pg.gather(list, t, {root})->wait();
  if (name == "scatter") pg.scatter(t, list, {root})->wait();
  if (name == "reduce_scatter") pg.reduce_scatter(t, list)->wait();
  if (name == "barrier") pg.barrier()->wait();
}

// TCP bytes per collective (read on rank 0; other ranks return zeros).
TcpBytes bytes_per_op(ProcessGroup& pg, const std::string& name, int64_t numel, int iters,
                      const std::map<std::string, std::string>& host_of_inode) {
  pg.barrier()->wait();
  const TcpBytes before = pg.rank() == 0 ? tcp_bytes(host_of_inode) : TcpBytes{};
  for (int i = 0; i < iters; ++i) run_collective(pg, name, numel);
  pg.barrier()->wait();  // every rank has finished: its bytes are counted
  if (pg.rank() != 0) return {};
  const TcpBytes after = tcp_bytes(host_of_inode);
  return {(after.all - before.all) / iters, (after.between_hosts - before.between_hosts) / iters};
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void measure(ProcessGroup& flat, ProcessGroup& hier, const Settings& s,
             const std::map<std::string, std::string>& host_of_inode) {
  const int64_t numel = s.bytes / 4;
  const std::vector<std::string> names = {"allreduce", "broadcast", "reduce",         "allgather",
                                          "gather",    "scatter",   "reduce_scatter", "barrier"};
  for (const auto& name : names) {
    run_collective(flat, name, numel);  // warm-up (first use of connections)
    run_collective(hier, name, numel);
    std::vector<double> flat_all, flat_between, hier_all, hier_between;
    for (int round = 0; round < s.rounds; ++round) {
      const TcpBytes a = bytes_per_op(flat, name, numel, s.iters, host_of_inode);
      const TcpBytes b = bytes_per_op(hier, name, numel, s.iters, host_of_inode);
      flat_all.push_back(a.all);
      flat_between.push_back(a.between_hosts);
      hier_all.push_back(b.all);
      hier_between.push_back(b.between_hosts);
    }
    if (flat.rank() != 0) continue;
    const double fa = median(flat_all), fb = median(flat_between);
    const double ha = median(hier_all), hb = median(hier_between);
    if (s.json) {
      std::printf("{\"bench\":\"hier_traffic\",\"hosts\":\"%s\",\"collective\":\"%s\","
                  "\"bytes\":%lld,\"gloo_between_hosts\":%.0f,\"hier_between_hosts\":%.0f,"
                  "\"ratio\":%.3f,\"gloo_tcp\":%.0f,\"hier_tcp\":%.0f}\n",
                  s.hosts.c_str(), name.c_str(), static_cast<long long>(s.bytes), fb, hb,
                  fb > 0 ? hb / fb : 0.0, fa, ha);
    } else {
      std::printf("%-15s between hosts: gloo %9.0f B, hierarchical %9.0f B (x%.3f);"
                  "  all TCP: %9.0f B, %9.0f B\n",
                  name.c_str(), fb, hb, fb > 0 ? hb / fb : 0.0, fa, ha);
    }
    std::fflush(stdout);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Settings s;
  CLI::App app{"TCP bytes per collective between pretended hosts: hierarchical against gloo"};
  app.add_option("--hosts", s.hosts, "pretended host of each rank, comma-separated");
  app.add_option("--bytes", s.bytes, "tensor size in bytes (per rank)");
  app.add_option("--iters", s.iters, "collectives per reading");
  app.add_option("--rounds", s.rounds, "A B rounds");
  app.add_flag("--json", s.json, "one JSON object per line");
  CLI11_PARSE(app, argc, argv);
  std::vector<std::string> hosts;
  std::stringstream list(s.hosts);
  for (std::string h; std::getline(list, h, ',');) hosts.push_back(h);
  const int np = static_cast<int>(hosts.size());
  if (!s.json) {
    std::printf("%d ranks on hosts %s, %lld B per rank, bytes sent per collective, medians of %d "
                "rounds of %d\n",
                np, s.hosts.c_str(), static_cast<long long>(s.bytes), s.rounds, s.iters);
  }
  std::fflush(stdout);
  auto results = shoal::testing::run_processes(
      np,
      [&](int rank, const std::string& path) {
        torch::set_num_threads(1);
        setenv("SHOAL_HOSTNAME", hosts[rank].c_str(), 1);
        auto store = shoal::comm::make_file_store(path, np);
        auto flat = shoal::comm::new_process_group(
            "gloo", shoal::comm::make_prefix_store("flat", store), rank, np);
        auto hier = shoal::comm::new_process_group(
            "hierarchical", shoal::comm::make_prefix_store("hier", store), rank, np);
        // Every group is connected: its sockets exist and last as long as the group.
        store->set_string("traffic/inodes/" + std::to_string(rank), my_socket_inodes());
        std::map<std::string, std::string> host_of_inode;
        for (int r = 0; r < np; ++r) {
          std::stringstream inodes(store->get_string("traffic/inodes/" + std::to_string(r)));
          for (std::string inode; std::getline(inodes, inode, ',');) {
            host_of_inode[inode] = hosts[r];
          }
        }
        measure(*flat, *hier, s, host_of_inode);
      },
      Milliseconds(600'000));
  int failed = 0;
  for (const auto& r : results) {
    if (!r.ok()) {
      std::fprintf(stderr, "rank %d failed: %s\n", r.rank, r.error.c_str());
      failed = 1;
    }
  }
  return failed;
}
