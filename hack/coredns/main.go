// Command coredns is CoreDNS v1.12.4 (pinned in go.mod) built with only the plugins
// kvtier's real-node test cluster uses, the way CoreDNS documents custom builds: set
// dnsserver.Directives to the ordered plugin list, blank-import those plugins, and call
// coremain.Run(). Importing github.com/coredns/coredns/core/plugin instead would pull in
// every plugin (the AWS, Azure, GCP, etcd, DataDog and dnstap SDKs among them).
//
// Built and cached by hack/coredns.sh.
package main

import (
	"github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"

	// The plugins, one per directive below ("prometheus" lives in plugin/metrics).
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/loop"
	_ "github.com/coredns/coredns/plugin/metrics"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/whoami"
)

// directives is the subsequence of upstream's core/dnsserver/zdirectives.go (v1.12.4)
// for the plugins imported above, in the same order: a request passes through them
// top to bottom, so the order is upstream's, not alphabetical.
var directives = []string{
	"bind",
	"ready",
	"health",
	"prometheus",
	"errors",
	"log",
	"loadbalance",
	"cache",
	"kubernetes",
	"loop",
	"forward",
	"whoami",
}

func init() {
	dnsserver.Directives = directives
}

func main() {
	coremain.Run()
}
