import sys, time, threading
sys.argv = ["x"]
sys.path.insert(0, "/tmp/startup")
import compile_times as C
gaps = []; stop = False
def tick():
    last = time.perf_counter()
    while not stop:
        time.sleep(0.002); now = time.perf_counter(); gaps.append(now - last); last = now
t = threading.Thread(target=tick); t.start()
t0 = time.perf_counter(); C.V["P16f"](); dt = time.perf_counter() - t0
stop = True; t.join()
gaps.sort()
print(f"compile {dt:.2f}s ticks {len(gaps)} max gap {gaps[-1]:.3f}s  gaps>50ms total {sum(g for g in gaps if g > 0.05):.2f}s  top5 {[round(g,2) for g in gaps[-5:]]}")
