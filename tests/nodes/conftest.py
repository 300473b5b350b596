"""The real-node cluster's fixtures (one cluster for the node tests' module, see kvtier_testenv.node_fixtures)."""
from kvtier_testenv.node_fixtures import node_cluster, pytest_collection_modifyitems  # noqa: F401
