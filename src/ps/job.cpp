#include "shoal/ps/job.h"

#include <cstdio>
#include <cstdlib>

#include "shoal/comm/store.h"
#include "log/error_file.h"
#include "shoal/env.h"
#include "shoal/error.h"

namespace shoal::ps {
namespace {

std::string env_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::string(value) : fallback;
}

int env_int(const char* name, int fallback) {
  const std::string value = env_or(name, "");
  if (value.empty()) return fallback;
  try {
    size_t used = 0;
    const int parsed = std::stoi(value, &used);
    if (used == value.size()) return parsed;
  } catch (const std::exception&) {
  }
  SHOAL_THROW(InvalidArgument, "parameter-server job: ", name, "=", value, " is not an integer");
}

std::shared_ptr<comm::Store> job_store(const Job& job) {
  // Server 0 hosts the store; everyone else connects (retrying until the store's timeout).
  const bool hosts = job.is_server() && job.role_rank == 0;
  return comm::make_tcp_store(job.master_addr, job.master_port,
                              job.num_servers + job.num_workers, hosts,
                              comm::timeout_from_env(comm::kDefaultTimeout));
}

std::string server_key(int rank) { return "ps/server/" + std::to_string(rank); }

}  // namespace

Job job_from_env() {
  Job job;
  job.role = env_or("ROLE_NAME", "worker");
  SHOAL_CHECK_T(InvalidArgument, job.role == "server" || job.role == "worker",
                "parameter-server job: ROLE_NAME=", job.role, "; expected server or worker");
  job.role_rank = env_int("ROLE_RANK", env_int("RANK", 0));
  job.num_servers = static_cast<int>(env::integer(env::Var::kPsNumServers).value_or(1));
  job.num_workers = static_cast<int>(env::integer(env::Var::kPsNumWorkers).value_or(1));
  job.master_addr = env_or("MASTER_ADDR", "127.0.0.1");
  job.master_port = env_int("MASTER_PORT", 29500);
  SHOAL_CHECK_T(InvalidArgument, job.num_servers >= 1 && job.num_workers >= 1,
                "parameter-server job: needs at least one server and one worker (got ",
                job.num_servers, " and ", job.num_workers, ")");
  const int size = job.is_server() ? job.num_servers : job.num_workers;
  SHOAL_CHECK_T(InvalidArgument, job.role_rank >= 0 && job.role_rank < size,
                "parameter-server job: ", job.role, " rank ", job.role_rank, " is not in 0..",
                size - 1);
  return job;
}

ServerStats serve(const Job& job, ServerOptions options) {
  SHOAL_CHECK_T(InvalidArgument, job.is_server(), "serve(): this process is a ", job.role);
  options.rank = job.role_rank;
  options.num_workers = job.num_workers;
  options.bind = "tcp://" + env::text(env::Var::kPsHost).value_or(job.master_addr) + ":*";
  std::shared_ptr<comm::Store> store = job_store(job);
  // Server 0's store closing is what fails the workers: a failure here is noted before it goes.
  const log::FailureNote failure_note;
  Server server(std::move(options));
  store->set_string(server_key(job.role_rank), server.endpoint());
  server.run();
  return server.stats();
}

std::vector<std::string> server_endpoints(const Job& job) {
  std::shared_ptr<comm::Store> store = job_store(job);
  std::vector<std::string> endpoints;
  for (int s = 0; s < job.num_servers; ++s) endpoints.push_back(store->get_string(server_key(s)));
  return endpoints;
}

std::unique_ptr<Worker> connect_worker(const Job& job, WorkerOptions options,
                                       std::vector<std::pair<std::string, at::Tensor>> parameters) {
  SHOAL_CHECK_T(InvalidArgument, !job.is_server(), "connect_worker(): this process is a server");
  options.rank = job.role_rank;
  options.num_workers = job.num_workers;
  options.servers = server_endpoints(job);
  return std::make_unique<Worker>(std::move(options), std::move(parameters));
}

}  // namespace shoal::ps
