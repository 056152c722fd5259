"""History: the PySpark job that archives records to Parquet and compacts the log.

`run_compaction(dsn, schema, ...)` runs (or resumes) one run; `bus compact`
(`command.py`: progress display, status, `--every`) and
`spark-submit bus/compaction/job.py` call it. See `job.py` for what
counts as history and how a run survives crashes, `spark.py` for Java 17 and
the JDBC driver. Its SQL lives in `storage.compaction`.
"""

from bus.compaction.driver import Progress
from bus.compaction.job import (
    CHECKPOINTS,
    CompactionBusyError,
    CompactionReport,
    PartitionOutcome,
    run_compaction,
)
from bus.compaction.spark import SparkSetupError, jdbc_target, spark_session

__all__ = [
    "CHECKPOINTS",
    "CompactionBusyError",
    "CompactionReport",
    "PartitionOutcome",
    "Progress",
    "SparkSetupError",
    "jdbc_target",
    "run_compaction",
    "spark_session",
]
