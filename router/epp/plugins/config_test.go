package plugins

import (
	"os"
	"testing"

	"github.com/go-logr/logr"
	"sigs.k8s.io/gateway-api-inference-extension/pkg/epp/config/loader"
	fwkplugin "sigs.k8s.io/gateway-api-inference-extension/pkg/epp/framework/interface/plugin"
)

// The shipped EndpointPickerConfig decodes as the runner decodes it, every
// kvtier plugin's parameters are accepted by its factory, and the profile
// screens before it scores.
func TestShippedConfigInstantiatesKvtiersPlugins(t *testing.T) {
	data, err := os.ReadFile("../config/kvtier-epp.yaml")
	if err != nil {
		t.Fatal(err)
	}
	raw, _, err := loader.LoadRawConfig(data, logr.Discard())
	if err != nil {
		t.Fatal(err)
	}
	factories := map[string]fwkplugin.FactoryFunc{
		AffinityScorerType: AffinityScorerFactory, VersionScreenerType: VersionScreenerFactory,
		CacheSaltType: CacheSaltFactory,
	}
	made := map[string]bool{}
	for _, spec := range raw.Plugins {
		if factory, ok := factories[spec.Type]; ok {
			if _, err := factory(spec.Type, spec.Parameters, nil); err != nil {
				t.Fatalf("%s: %v", spec.Type, err)
			}
			made[spec.Type] = true
		}
	}
	if len(made) != len(factories) {
		t.Fatalf("made %v, want every kvtier plugin", made)
	}
	var refs []string
	for _, p := range raw.SchedulingProfiles[0].Plugins {
		refs = append(refs, p.PluginRef)
	}
	if want := []string{VersionScreenerType, AffinityScorerType, "max-score-picker"}; !equalStrings(refs, want) {
		t.Fatalf("profile %q, want %q", refs, want)
	}
}
