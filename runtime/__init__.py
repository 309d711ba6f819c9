"""The migration engine: residency table, plan executor, I/O queues, storage backends."""
