"""Request generators and latency/throughput reporting."""
