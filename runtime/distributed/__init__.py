"""Process groups for tensor parallelism and the signed rendezvous store they (and PD pairs) meet through."""
