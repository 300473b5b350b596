"""Real components for kvtier's tests and demo: redis-server, kube-apiserver + etcd,
kube-controller-manager, a node agent standing in for kubelet, kubectl and helm."""
