// Command kvtier-epp is the Gateway API Inference Extension's Endpoint Picker
// with kvtier's plugins compiled in (router/epp/plugins): the upstream runner,
// its flags and its EndpointPickerConfig, plus the plugin types
// kvtier-affinity-scorer, kvtier-version-screener and kvtier-cache-salt.
package main

import (
	"os"

	ctrl "sigs.k8s.io/controller-runtime"
	"sigs.k8s.io/gateway-api-inference-extension/cmd/epp/runner"

	"github.com/kvtier/kvtier/router/epp/plugins"
)

func main() {
	plugins.Register()
	if err := runner.NewRunner().Run(ctrl.SetupSignalHandler()); err != nil {
		os.Exit(1)
	}
}
