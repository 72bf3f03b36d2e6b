"""`sluice chaos`: a seeded workload, fuzzed records and a fault schedule against real worker
processes on the embedded stack, and an auditor that checks the wire contract on what came out.

One module per job: `workload` (valid requests), `fuzz` (hostile records), `faults` (the schedule
and how each fault is applied), `pool` (worker processes), `audit` (the contract checks, pure),
`report` (table, JSON, timeline plot), `run` (the orchestration).
"""
