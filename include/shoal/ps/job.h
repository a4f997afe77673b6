// A parameter-server job as `shoal run --num-servers S` (or `shoal train --strategy ps`) starts
// it: each process learns its role from the environment (ROLE_NAME "server" or "worker",
// ROLE_RANK, SHOAL_PS_NUM_SERVERS, SHOAL_PS_NUM_WORKERS, MASTER_ADDR, MASTER_PORT) and the
// servers' endpoints travel through the job's rendezvous store: server 0 hosts a TCP store at
// MASTER_ADDR:MASTER_PORT, every server publishes "ps/server/<rank>" = its ZeroMQ endpoint, and
// workers read them all (waiting at most the store's timeout).
//
//   auto job = shoal::ps::job_from_env();
//   if (job.is_server()) { shoal::ps::serve(job, server_options); return 0; }
//   auto worker = shoal::ps::connect_worker(job, worker_options, model->named_parameters());
//
// Servers bind on $SHOAL_PS_HOST, or MASTER_ADDR when unset (so on one node, loopback).
//
// Thread safety: plain functions; each call creates its own store connection.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "shoal/ps/server.h"
#include "shoal/ps/worker.h"

namespace shoal::ps {

struct Job {
  std::string role = "worker";  ///< "server" or "worker"
  int role_rank = 0;
  int num_servers = 1;
  int num_workers = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  bool is_server() const { return role == "server"; }
};

/// Reads the job from the environment; throws InvalidArgument naming what is missing.
Job job_from_env();

/// Binds a server with `options` (rank, num_workers and bind address taken from `job`),
/// publishes its endpoint and serves until every worker is done; returns what it observed.
ServerStats serve(const Job& job, ServerOptions options);

/// The servers' endpoints, read from the job's store.
std::vector<std::string> server_endpoints(const Job& job);

/// A worker of `job` connected to every server (rank and servers taken from `job`).
std::unique_ptr<Worker> connect_worker(const Job& job, WorkerOptions options,
                                       std::vector<std::pair<std::string, at::Tensor>> parameters);

}  // namespace shoal::ps
