//go:build tools

// Package tools pins the module hack/prometheus.sh builds, so `go mod tidy` keeps it.
package tools

import _ "github.com/prometheus/prometheus/cmd/prometheus"
