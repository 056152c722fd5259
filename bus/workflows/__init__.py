"""Durable workflows on the bus: runs as queue jobs, step records in PostgreSQL.

`bus.workflows.engine` runs them; `bus.workflows.context` is what a workflow
function gets (`ctx.step`, `ctx.transaction`, `ctx.sleep`, ...). Nothing is
imported here, so `import bus.errors` stays light.
"""
