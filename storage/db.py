"""The storage layer's connection plumbing under one name: `from storage import db; db.connect(...)`.

Each name lives in the module that says what it is: `storage.connections` (connections,
pools, the bus schema on the search_path, the transaction-pooler connection),
`storage.lender` (the Lender), `storage.codecs` (the driver's codecs), `storage.migrate`
(migrations), `storage.driver_errors` (what counts as PostgreSQL being away), `storage.clock`
(a statement's `now`). Import from here or from there; both name the same objects.
"""

from storage.clock import Now, server_clock
from storage.codecs import int_array, preload_array_types
from storage.connections import (
    POOLERS,
    SET_LOCAL_SEARCH_PATH,
    SET_SESSION_SEARCH_PATH,
    SHOW_SEARCH_PATH,
    Conn,
    Connection,
    Pooler,
    TransactionPooledConnection,
    check_dsn,
    connect,
    create_pool,
    create_service_pool,
    on_schema,
    pooled_connection_class,
    search_path,
    server_settings,
    through_transaction_pooler,
)
from storage.driver_errors import CONNECTION_ERRORS, TRANSIENT_ERRORS, translate_errors
from storage.lender import GENERIC_PLANS, Lender
from storage.migrate import (
    MIGRATION_ATTEMPTS,
    MIGRATION_LOCK_TIMEOUT,
    SET_LOCAL_LOCK_TIMEOUT,
    AppliedMigration,
    MigrationStatus,
    drop_schema,
    finalize,
    migrate,
    migration_file,
    migration_status,
    migrations,
    pending_sql,
)
from storage.names import validate_schema

__all__ = [
    "AppliedMigration",
    "CONNECTION_ERRORS",
    "Conn",
    "Connection",
    "GENERIC_PLANS",
    "Lender",
    "MIGRATION_ATTEMPTS",
    "MIGRATION_LOCK_TIMEOUT",
    "MigrationStatus",
    "Now",
    "POOLERS",
    "Pooler",
    "SET_LOCAL_LOCK_TIMEOUT",
    "SET_LOCAL_SEARCH_PATH",
    "SET_SESSION_SEARCH_PATH",
    "SHOW_SEARCH_PATH",
    "TRANSIENT_ERRORS",
    "TransactionPooledConnection",
    "check_dsn",
    "connect",
    "create_pool",
    "create_service_pool",
    "drop_schema",
    "finalize",
    "int_array",
    "migrate",
    "migration_file",
    "migration_status",
    "migrations",
    "on_schema",
    "pending_sql",
    "pooled_connection_class",
    "preload_array_types",
    "search_path",
    "server_clock",
    "server_settings",
    "through_transaction_pooler",
    "translate_errors",
    "validate_schema",
]
